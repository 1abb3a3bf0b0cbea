"""Where an experiment's clients train: the ``[engine]`` of a config, by name (``gradleak list``).

An :class:`EngineRunner` owns the lifetime of an engine: ``run(clients, defenses, work)`` sets up where the
clients live (nothing, in this process; Flower's simulation engine on Ray, one virtual SuperNode per
client), calls ``work(engine)`` with an :class:`~gradleak.federation.simulation.Engine` that trains the tasks
there, tears it down, and returns what ``work`` returned (or raises what it raised). The server loop,
defenses, attacks and seeds are the same whichever engine runs the clients.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from gradleak.federation.simulation import DefenseFactory, Engine, InProcessEngine
from gradleak.registry import ENGINES
from gradleak.tasks import Dataset

T = TypeVar("T")


class EngineRunner(Protocol):
    """Runs ``work`` with an engine that trains ``clients[k]`` for client id ``k`` (module docstring)."""

    def run(
        self,
        clients: Sequence[Dataset],
        defenses: DefenseFactory,
        work: Callable[[Engine], T],
        *,
        progress: bool = False,
        data_root: str | os.PathLike[str] | None = None,
    ) -> T: ...


@runtime_checkable
class FederationCheck(Protocol):
    """An engine config with conditions on the experiment's federation (checked with the config)."""

    def check_federation(
        self,
        *,
        secure_aggregation: bool,
        per_round: int,
        audited: int,
        random_subset: bool = False,
    ) -> None: ...


class InProcessRunner:
    """Clients train one after the other in this process (deterministic, no extra dependencies)."""

    def run(
        self,
        clients: Sequence[Dataset],
        defenses: DefenseFactory,
        work: Callable[[Engine], T],
        *,
        progress: bool = False,
        data_root: str | os.PathLike[str] | None = None,
    ) -> T:
        return work(InProcessEngine(progress, data_root))


ENGINES.register("inprocess", InProcessRunner, summary="clients train in this process, one after the other")

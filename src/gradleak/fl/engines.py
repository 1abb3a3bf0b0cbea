"""Where an experiment's clients train: the ``[engine]`` of a config, by name (``gradleak list``).

An :class:`EngineRunner` owns the lifetime of an engine: ``run(clients, defenses, work)`` sets up where the
clients live (nothing, in this process; Flower's simulation engine on Ray, one virtual SuperNode per
client), calls ``work(engine)`` with an :class:`~gradleak.fl.simulation.Engine` that trains the tasks
there, tears it down, and returns what ``work`` returned (or raises what it raised). The server loop,
defenses, attacks and seeds are the same whichever engine runs the clients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from gradleak.data.base import ImageDataset
from gradleak.fl.simulation import DefenseFactory, Engine, InProcessEngine
from gradleak.registry import ENGINES

T = TypeVar("T")


class EngineRunner(Protocol):
    """Runs ``work`` with an engine that trains ``clients[k]`` for client id ``k`` (module docstring)."""

    def run(
        self,
        clients: Sequence[ImageDataset],
        defenses: DefenseFactory,
        work: Callable[[Engine], T],
        *,
        progress: bool = False,
    ) -> T: ...


class InProcessRunner:
    """Clients train one after the other in this process (deterministic, no extra dependencies)."""

    def run(
        self,
        clients: Sequence[ImageDataset],
        defenses: DefenseFactory,
        work: Callable[[Engine], T],
        *,
        progress: bool = False,
    ) -> T:
        return work(InProcessEngine(progress))


@dataclass(frozen=True)
class FlowerEngineConfig:
    """Flower's simulation engine with the Ray backend.

    ``timeout``: seconds the server waits for a round's replies (a node that has not answered by then is
    recorded as dropped; the round goes on). ``client_cpus``: CPU cores Ray reserves per virtual client;
    ``cpus``: the cores Ray may use in all (so ``cpus / client_cpus`` clients train at once).
    ``startup_timeout``: seconds to wait for every virtual SuperNode to register and answer.
    """

    timeout: float = 600.0
    client_cpus: float = 1.0
    cpus: int = 2
    startup_timeout: float = 120.0

    def __post_init__(self) -> None:
        for key in ("timeout", "client_cpus", "startup_timeout"):
            value = getattr(self, key)
            if not 0 < value < math.inf:
                raise ValueError(f"{key} must be a positive finite number, got {value!r}")
        if self.cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {self.cpus}")
        if self.client_cpus > self.cpus:
            raise ValueError(
                f"client_cpus = {self.client_cpus} exceeds cpus = {self.cpus}: no client could be scheduled"
            )


def flower_runner(config: FlowerEngineConfig) -> EngineRunner:
    """The Flower engine (needs the ``flower`` extra: ``pip install 'gradleak[flower]'``)."""
    try:
        from gradleak.integrations.flower.engine import FlowerRunner
    except ImportError as exc:
        raise RuntimeError(
            f"engine 'flower' needs Flower and Ray ({exc}); install the flower extra: "
            "pip install 'gradleak[flower]' (the project's `make` bootstrap includes it)"
        ) from None
    return FlowerRunner(config)


ENGINES.register("inprocess", InProcessRunner, summary="clients train in this process, one after the other")
ENGINES.register(
    "flower", flower_runner, config_cls=FlowerEngineConfig,
    summary="Flower's simulation engine on Ray: one virtual SuperNode per client",
)  # fmt: skip

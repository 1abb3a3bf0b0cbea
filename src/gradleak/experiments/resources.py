"""What a run will cost, estimated before any work, and refused when it cannot fit.

A config is a file anyone may hand you: ``data.num_clients = 1000000000``, ``fl.rounds = 1000000000`` or
``audit.views = 1000000`` were accepted and ran until the machine gave out. Before the first round the
runner estimates (from the config and the built model, nothing trained):

- **clients**: every client needs at least one training sample (``num_clients <= len(train)``);
- **client trainings**: ``fl.rounds x`` the clients sampled per round, plus the audit's, at most
  :data:`MAX_CLIENT_TRAININGS` (a million local trainings: days on any machine);
- **memory held by the audit**: each audited client's ``views`` updates (and the broadcast model) are held
  at once, ``(views + 1) x clients x`` the model's bytes, at most :data:`MEMORY_SHARE` of this machine's
  physical memory.

A refusal names the estimate and the way out: ``experiment.resource_limits = false`` runs it anyway.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from gradleak.experiments.config import ExperimentConfig

MAX_CLIENT_TRAININGS = 1_000_000
MEMORY_SHARE = 0.5  # of the physical memory: the data, the model and torch need the rest
OVERRIDE = "set experiment.resource_limits = false to run it anyway"


class ResourceError(ValueError):
    """A run that would not fit this machine (the message gives the estimate and the override)."""


def physical_memory() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def check_resources(cfg: ExperimentConfig, model: nn.Module, train_samples: int) -> None:
    """Raise :class:`ResourceError` when ``cfg`` cannot run here (module docstring); a no-op with
    ``experiment.resource_limits = false``, except for what cannot run at all (a client without data)."""
    clients = cfg.data.num_clients
    if clients > train_samples:
        raise ResourceError(
            f"data.num_clients = {clients} exceeds the {train_samples} training samples: every client needs "
            "at least one"
        )
    if not cfg.experiment.resource_limits:
        return
    per_round = max(1, math.ceil(cfg.fl.fraction * clients))
    audited = cfg.audit.clients * cfg.audit.views
    trainings = cfg.fl.rounds * per_round + audited
    if trainings > MAX_CLIENT_TRAININGS:
        raise ResourceError(
            f"fl.rounds = {cfg.fl.rounds} x {per_round} clients a round (+ {audited} audited) is "
            f"{trainings:,} local trainings, over {MAX_CLIENT_TRAININGS:,}; {OVERRIDE}"
        )
    held = (cfg.audit.views + 1) * max(1, cfg.audit.clients) * model_bytes(model)
    memory = physical_memory()
    if memory and held > MEMORY_SHARE * memory:
        raise ResourceError(
            f"audit.views = {cfg.audit.views} for {cfg.audit.clients} audited client(s) holds "
            f"{held / 2**30:.1f} GiB of updates at once, over {MEMORY_SHARE:.0%} of this machine's "
            f"{memory / 2**30:.1f} GiB; lower audit.views or audit.clients, or {OVERRIDE}"
        )

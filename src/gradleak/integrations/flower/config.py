"""The ``flower`` engine's settings (``[engine] name = "flower"`` and its ``secagg`` table): plain
dataclasses, checked with the config, importable without Flower."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MODULUS_RANGE = 2**32  # SecAgg+'s arithmetic modulus (Flower's default)


@dataclass(frozen=True)
class SecAggPlusConfig:
    """Flower's SecAgg+ protocol (Bell et al. 2020, as ``SecAggPlusWorkflow`` / ``secaggplus_mod``) for
    every round and the audit of an experiment with ``fl.secure_aggregation = true``: the server unmasks
    only the aggregate, as a real SecAgg+ server does.

    ``share_fraction``: the fraction of a round's clients each one shares its secrets with (Flower's
    ``num_shares`` as a float); ``threshold_fraction``: the fraction of those shares that rebuild a dropped
    client's masks (Flower's ``reconstruction_threshold``). ``clipping_range`` ``c``: an update's entries
    must lie in ``[-c, c]``; a client whose update leaves it fails closed (no update, the reason recorded)
    rather than being clipped silently. ``quantization_range``: the levels over ``[-c, c]``, so an
    aggregate entry is exact to ``2c / quantization_range`` per client (stochastic rounding).
    """

    enabled: bool = False
    share_fraction: float = 1.0
    threshold_fraction: float = 0.6
    clipping_range: float = 8.0
    quantization_range: int = 2**22

    def __post_init__(self) -> None:
        for key in ("share_fraction", "threshold_fraction"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"secagg.{key} must be in (0, 1], got {value!r}")
        if not 0 < self.clipping_range < math.inf:
            raise ValueError(
                f"secagg.clipping_range must be a positive finite number, got {self.clipping_range!r}"
            )
        if not 1 < self.quantization_range < MODULUS_RANGE:
            raise ValueError(
                f"secagg.quantization_range must be an int in (1, 2**32), got {self.quantization_range!r}"
            )

    def check_round_size(self, clients: int, where: str) -> None:
        """SecAgg+ needs >= 2 clients, and their quantised sum must not wrap around the modulus."""
        if not self.enabled:
            return
        if clients < 2:
            raise ValueError(f"SecAgg+ needs at least 2 clients in a round; {where} has {clients}")
        if clients * self.quantization_range >= MODULUS_RANGE:
            raise ValueError(
                f"SecAgg+ with {clients} clients and quantization_range = {self.quantization_range} "
                f"overflows the 2**32 modulus ({where}); lower secagg.quantization_range below "
                f"{MODULUS_RANGE // clients}"
            )


@dataclass(frozen=True)
class FlowerEngineConfig:
    """Flower's simulation engine with the Ray backend.

    ``timeout``: seconds the server waits for a round's replies (a node that has not answered by then is
    recorded as dropped; the round goes on). ``client_cpus``: CPU cores Ray reserves per virtual client;
    ``cpus``: the cores Ray may use in all (so ``cpus / client_cpus`` clients train at once).
    ``startup_timeout``: seconds to wait for every virtual SuperNode to register and answer.
    ``secagg``: run Flower's SecAgg+ protocol (:class:`SecAggPlusConfig`) under ``fl.secure_aggregation``.
    """

    timeout: float = 600.0
    client_cpus: float = 1.0
    cpus: int = 2
    startup_timeout: float = 120.0
    secagg: SecAggPlusConfig = field(default_factory=SecAggPlusConfig)

    def check_federation(
        self,
        *,
        secure_aggregation: bool,
        per_round: int,
        audited: int,
        random_subset: bool = False,
    ) -> None:
        """SecAgg+ is the protocol of a secure-aggregation threat model, with rounds it can run; a node is
        told how many of its first samples an audit trains on (``random_subset``: a random subset, which it
        cannot be told)."""
        if random_subset:
            raise ValueError(
                "the Flower engine sends an audited node a sample count, so audit.pick = 'random' (a random "
                "subset of max_samples) is not available on it; use audit.pick = 'first'"
            )
        if not self.secagg.enabled:
            return
        if not secure_aggregation:
            raise ValueError(
                "secagg.enabled runs Flower's SecAgg+ protocol, which needs fl.secure_aggregation = true "
                "(the threat model in which the server sees only the aggregate)"
            )
        self.secagg.check_round_size(per_round, "a training round (fl.fraction of data.num_clients)")
        self.secagg.check_round_size(audited, "the audit (audit.clients)")

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

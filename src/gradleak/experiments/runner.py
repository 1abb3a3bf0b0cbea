"""Run one experiment: data -> partition -> model -> FL rounds -> audited round -> attacks -> metrics.

Everything is validated before work starts; records are kept in memory and written to the store in one
transaction at the very end, so a failure leaves no partial rows. Attacks receive only Observations built
by :func:`gradleak.fl.server_view`; ground truth meets the reconstructions only in :func:`_score`.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import platform
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.data import load_dataset, partition, resolve_data_root
from gradleak.data.base import ImageDataset
from gradleak.defenses.base import Defense
from gradleak.experiments.config import ExperimentConfig
from gradleak.experiments.figures import save_reconstruction_grid
from gradleak.experiments.store import ResultStore, RunRow
from gradleak.fl import FederatedSimulation, derive_seed, evaluate, server_view
from gradleak.fl.client import ClientResult
from gradleak.metrics import score_images
from gradleak.models import build_model
from gradleak.registry import DEFENSES
from gradleak.types import ClientCustomizingAttack, ModelModifyingAttack, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    """What a finished run produced (also in the store)."""

    run_id: str
    config: ExperimentConfig
    records: list[dict[str, Any]]
    figures: list[Path] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["kind"] == kind]


def environment() -> dict[str, Any]:
    """Where a run happened: git commit, machine, library versions."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "git_commit": commit or "unknown",
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def load_split_data(cfg: ExperimentConfig) -> tuple[ImageDataset, ImageDataset]:
    """Train and test sets; when both name the same split, a seeded ``holdout`` share becomes the test set."""
    d = cfg.data
    root = resolve_data_root(cfg.experiment.data_root)
    if d.train_split != d.test_split:
        train = load_dataset(d.dataset, d.train_split, root, d.train_limit)
        test = load_dataset(d.dataset, d.test_split, root, d.test_limit)
        return train, test
    full = load_dataset(d.dataset, d.train_split, root, None)
    order = np.random.default_rng(derive_seed(cfg.experiment.seed, 0xDA7A)).permutation(len(full))
    n_test = max(1, int(round(d.holdout * len(full))))
    test_idx, train_idx = order[:n_test], order[n_test:]
    if d.test_limit is not None:
        test_idx = test_idx[: d.test_limit]
    if d.train_limit is not None:
        train_idx = train_idx[: d.train_limit]
    return full.subset(np.sort(train_idx)), full.subset(np.sort(test_idx))


def _label_accuracy(recovered: torch.Tensor | None, truth: torch.Tensor) -> float | None:
    """Fraction of true labels recovered, as multisets (order-free)."""
    if recovered is None:
        return None
    hit = Counter(recovered.tolist()) & Counter(truth.tolist())
    return sum(hit.values()) / max(1, len(truth))


def _score(rec: Reconstruction, truth: ImageDataset) -> dict[str, Any]:
    out: dict[str, Any] = {"label_accuracy": _label_accuracy(rec.labels, truth.labels)}
    if rec.images is not None:
        out.update(score_images(rec.images, truth.images).to_dict())
    return out


def _truth_for(obs: Observation, results: list[ClientResult]) -> ImageDataset:
    received = [r for r in results if r.update is not None and r.truth is not None]
    if not obs.aggregated:
        cid = obs.update.metadata.get("client_id")
        return next(r.truth for r in received if r.update.metadata.get("client_id") == cid)  # type: ignore
    parts = [r.truth for r in received]
    return ImageDataset(
        parts[0].name,  # type: ignore[union-attr]
        torch.cat([p.images for p in parts]),  # type: ignore[union-attr]
        torch.cat([p.labels for p in parts]),  # type: ignore[union-attr]
        parts[0].num_classes,  # type: ignore[union-attr]
    )


Figure = tuple[torch.Tensor, torch.Tensor, str, list[str]]


def _figure(
    name: str, obs: Observation, images: torch.Tensor, truth: torch.Tensor, scores: dict[str, Any]
) -> Figure:
    """Originals and their matched reconstructions (at most 16), captioned with per-image PSNR."""
    matched = [j for j, i in enumerate(scores["matching"]) if i >= 0][:16]
    recon = images[[scores["matching"][j] for j in matched]]
    caps = [f"{scores['psnr'][m]:.1f} dB" for m in range(len(matched))]
    title = f"{name} on client {obs.update.metadata.get('client_id', 'sum')}"
    return truth[matched], recon, title, caps


def collect_malicious(
    sim: FederatedSimulation,
    attack: ModelModifyingAttack,
    broadcast: nn.Module,
    ids: list[int],
    cfg: ExperimentConfig,
) -> list[ClientResult]:
    """Audited clients train the server's model; a client-customising attack sends each its own variant."""
    a = cfg.audit
    if not isinstance(attack, ClientCustomizingAttack):
        return sim.collect(ids, a.training, broadcast=broadcast, max_samples=a.max_samples)
    return [
        r
        for slot, cid in enumerate(ids)
        for r in sim.collect(
            [cid], a.training, broadcast=attack.customize(broadcast, slot), max_samples=a.max_samples
        )
    ]


def any_model_modifying(cfg: ExperimentConfig) -> bool:
    return any(
        isinstance(create_attack(s.name, **s.options), ModelModifyingAttack) for s in cfg.audit.attacks
    )


def load_public_images(cfg: ExperimentConfig, test: ImageDataset) -> torch.Tensor:
    """The server's auxiliary images: a configured public set, else the held-out test set."""
    a = cfg.audit
    if a.public_dataset is None and a.public_split is None:
        data = test
    else:
        root = resolve_data_root(cfg.experiment.data_root)
        data = load_dataset(a.public_dataset or cfg.data.dataset, a.public_split, root, None)
    return data.images[: a.public_limit]


def run_experiment(
    cfg: ExperimentConfig,
    *,
    store: ResultStore | None = None,
    out_dir: str | Path | None = None,
    progress: bool = False,
) -> RunOutcome:
    """Run ``cfg`` end to end; write the store and figures only once everything has succeeded."""
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    run_id = f"{cfg.experiment.name}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    seed = cfg.experiment.seed
    t0 = time.perf_counter()
    train, test = load_split_data(cfg)
    parts = partition(
        cfg.data.partition,
        train,
        cfg.data.num_clients,
        derive_seed(seed, 0x9A27),
        **cfg.data.partition_options,
    )
    clients = [train.subset(p) for p in parts]
    model = build_model(
        cfg.model.name,
        train.input_shape,
        train.num_classes,
        seed=derive_seed(seed, 0x30DE),
        **cfg.model.options,
    )

    def defenses() -> list[Defense]:
        return [DEFENSES.create(s.name, **s.options) for s in cfg.defenses]

    sim = FederatedSimulation(model, clients, cfg.fl, seed=seed, test=test, defenses=defenses)
    records: list[dict[str, Any]] = []
    for rr in sim.run(progress=progress):
        records.append(
            {"kind": "round", "round": rr.round, "clients": rr.client_ids, "accuracy": rr.accuracy,
             "seconds": rr.seconds, "dropped": rr.dropped}
        )  # fmt: skip
    fl_seconds = time.perf_counter() - t0

    audit = cfg.audit
    last = sim.history[-1].accuracy if sim.history else None  # accuracy of the broadcast the audit attacks
    audited_accuracy = last if last is not None else evaluate(sim.model, test.images, test.labels)
    pending_figures: list[Figure] = []
    if audit.clients > 0:
        ids = sim.sample()[: audit.clients]
        public = load_public_images(cfg, test) if any_model_modifying(cfg) else None
        honest: list[ClientResult] | None = None
        for spec in audit.attacks:
            attack = create_attack(spec.name, **spec.options)
            broadcast: nn.Module = sim.model
            secrets: Mapping[str, object] = {}
            if isinstance(attack, ModelModifyingAttack):  # the server broadcasts its own model this round
                gen = torch.Generator().manual_seed(derive_seed(seed, 0xBAD, len(records)))
                broadcast, secrets = attack.prepare(copy.deepcopy(sim.model), public, generator=gen)
                results = collect_malicious(sim, attack, broadcast, ids, cfg)
            else:
                if honest is None:
                    honest = sim.collect(ids, audit.training, max_samples=audit.max_samples)
                results = honest
            observations = server_view(
                broadcast, results, input_shape=train.input_shape, num_classes=train.num_classes,
                secure_aggregation=cfg.fl.secure_aggregation,
                training=audit.training if audit.training_public else None, grant_labels=audit.grant_labels,
                secrets=secrets,
            )  # fmt: skip
            for k, obs in enumerate(observations):
                gen = torch.Generator().manual_seed(derive_seed(seed, 0xA77C, k))
                rec = attack.reconstruct(obs, generator=gen)
                truth = _truth_for(obs, results)
                scores = _score(rec, truth)
                records.append(
                    {"kind": "attack", "attack": spec.name, "options": dict(spec.options),
                     "client_id": obs.update.metadata.get("client_id"), "aggregated": obs.aggregated,
                     "num_clients": obs.num_clients, "batch_size": len(truth), **rec.stats, **scores}
                )  # fmt: skip
                if rec.images is not None and "matching" in scores:
                    pending_figures.append(_figure(spec.name, obs, rec.images, truth.images, scores))

    records.append(
        {"kind": "summary", "final_accuracy": audited_accuracy, "fl_seconds": fl_seconds,
         "total_seconds": time.perf_counter() - t0, "num_clients": len(clients), "train_size": len(train),
         "test_size": len(test)}
    )  # fmt: skip

    figures: list[Path] = []
    if out_dir is not None:
        for i, (orig, recon, title, caps) in enumerate(pending_figures):
            path = Path(out_dir) / f"reconstructions_{i}.png"
            figures.append(save_reconstruction_grid(orig, recon, path, title=title, captions=caps))
    if store is not None:
        finished = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        store.write_run(
            RunRow(run_id, cfg.experiment.name, started, finished, cfg.to_dict(), environment()), records
        )
    return RunOutcome(run_id, cfg, records, figures)

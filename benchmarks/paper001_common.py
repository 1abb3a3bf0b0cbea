"""Shared setting of the paper 001 (PI-SME) benchmarks: victim clients, attacks, scoring.

Victim protocol (paper 001, Sec. 4): one client with k images trains the 2 conv + 2 FC victim
(``sme_cnn``) with plain SGD in batches of B for E epochs, T = E * ceil(k / B) local steps, and sends
``w_T - w_0``. The paper uses k = 50, B = 10, E = 20 (T = 100) and E = 50 (T = 250); smaller scales keep T
and shrink k and B (labelled in every result). The local learning rate is not given in paper 001; we use
``VICTIM_LR`` (our choice, fixed before any attack was run on benchmark images).

Data (never tuned on): CIFAR-10 test images with an even index (the loader orders them by class, so that
is 500 per class), minus the few images looked at while developing the attacks (``DEV_IMAGES``); CIFAR-10
stands in for CIFAR-100, which is not available here. FEMNIST: *test* writers (the attacks were developed
on FEMNIST train and the first test writer, which the unit tests use). A seed picks the client (random
CIFAR images; a random writer with >= k images) and the victim's initial weights.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from gradleak.attacks import create_attack
from gradleak.attacks.image.ig import cosine_distance
from gradleak.data import ImageDataset, load_dataset
from gradleak.fl.client import train_client
from gradleak.metrics import score_images
from gradleak.models import build_model
from gradleak.types import LocalTraining, Observation

VICTIM_LR = 0.01
DEV_IMAGES = (range(1000, 1050), range(5000, 5020))  # CIFAR-10 test indices used during development


def cifar_pool() -> torch.Tensor:
    """The CIFAR-10 test indices the benchmarks draw clients from."""
    dev = {i for r in DEV_IMAGES for i in r}
    return torch.tensor([i for i in range(0, 10_000, 2) if i not in dev])


DATASETS = {"cifar10": ("cifar10", "test"), "femnist": ("femnist", "test")}

# Paper 001 numbers (CIFAR-100 stands beside our CIFAR-10). Table 1: PSNR mean, PSNR variance, SSIM, FSIM,
# LPIPS, L_sim.
PAPER_TABLE1: dict[str, dict[int, dict[str, tuple[float, float, float, float, float, float]]]] = {
    "cifar10": {
        100: {
            "ig": (15.01, 0.3156, 0.384, 0.719, 0.461, 0.1385),
            "sme": (21.88, 0.9726, 0.733, 0.861, 0.242, 0.0452),
            "nlsme": (25.77, 0.2115, 0.855, 0.920, 0.163, 0.0032),
            "pisme": (26.52, 0.4288, 0.868, 0.926, 0.149, 0.0017),
        },
        250: {
            "ig": (12.28, 0.2554, 0.221, 0.664, 0.517, 0.2681),
            "sme": (18.26, 0.3333, 0.563, 0.765, 0.389, 0.0625),
            "nlsme": (20.29, 0.4908, 0.685, 0.827, 0.316, 0.0079),
            "pisme": (23.20, 0.3706, 0.778, 0.868, 0.248, 0.0036),
        },
    },
    "femnist": {
        100: {
            "ig": (17.09, 0.3498, 0.524, 0.695, 0.365, 0.1617),
            "sme": (22.27, 0.4209, 0.790, 0.880, 0.173, 0.0338),
            "nlsme": (24.06, 0.2576, 0.877, 0.956, 0.056, 0.0009),
            "pisme": (25.34, 0.3513, 0.904, 0.966, 0.048, 0.0006),
        },
        250: {
            "ig": (13.64, 0.3229, 0.397, 0.609, 0.429, 0.3102),
            "sme": (21.35, 0.3961, 0.754, 0.851, 0.213, 0.0482),
            "nlsme": (23.14, 0.1863, 0.848, 0.945, 0.076, 0.0014),
            "pisme": (24.37, 0.2922, 0.886, 0.962, 0.061, 0.0006),
        },
    },
}


@dataclass(frozen=True)
class Victim:
    k: int  # images on the client
    batch_size: int
    epochs: int

    @property
    def steps(self) -> int:
        return self.epochs * -(-self.k // self.batch_size)


_CACHE: dict[str, ImageDataset] = {}


def dataset(name: str) -> ImageDataset:
    if name not in _CACHE:
        ds, split = DATASETS[name]
        _CACHE[name] = load_dataset(ds, split)
    return _CACHE[name]


def femnist_pool() -> torch.Tensor:
    """FEMNIST test indices of every writer but the unit tests' one."""
    data = dataset("femnist")
    assert data.groups is not None
    return torch.nonzero(data.groups != data.groups[0]).flatten()


def client_data(name: str, k: int, seed: int, num_classes: int | None = None) -> ImageDataset:
    """k images of one client: random CIFAR pool images, or the first k images of a random FEMNIST test
    writer with at least k images. With ``num_classes`` the k images come from that many random classes
    (at least one image each; for FEMNIST pooled over the test writers, classes with >= k images)."""
    data = dataset(name)
    g = torch.Generator().manual_seed(10_000 + seed)
    if name == "femnist" and num_classes is None:
        assert data.groups is not None
        counts = torch.bincount(data.groups)
        writers = torch.nonzero(counts >= k).flatten()
        writers = writers[writers != data.groups[0]]  # the unit tests' writer
        w = writers[torch.randint(len(writers), (1,), generator=g)]
        idx = torch.nonzero(data.groups == w).flatten()[:k]
        return data.subset(idx)
    pool = cifar_pool() if name == "cifar10" else femnist_pool()
    if num_classes is not None:
        counts = torch.bincount(data.labels[pool], minlength=data.num_classes)
        eligible = torch.nonzero(counts >= k).flatten()
        if len(eligible) < num_classes:
            raise ValueError(f"{name}: only {len(eligible)} classes have >= {k} images, need {num_classes}")
        classes = eligible[torch.randperm(len(eligible), generator=g)[:num_classes]]
        pool = pool[torch.isin(data.labels[pool], classes)]
        # at least one image of every chosen class, the rest at random
        first = torch.stack([pool[data.labels[pool] == c][0] for c in classes])
        rest = pool[~torch.isin(pool, first)]
        idx = torch.cat([first, rest[torch.randperm(len(rest), generator=g)[: k - num_classes]]])
        return data.subset(idx.sort().values)
    idx = pool[torch.randperm(len(pool), generator=g)[:k]]
    return data.subset(idx.sort().values)


def victim_update(
    name: str, victim: Victim, seed: int, num_classes: int | None = None
) -> tuple[Observation, ImageDataset, LocalTraining]:
    """The server's view of one victim client's FedAvg update (recipe public, labels not granted)."""
    data = client_data(name, victim.k, seed, num_classes)
    full = dataset(name)
    model = build_model("sme_cnn", full.input_shape, full.num_classes, seed=seed)
    training = LocalTraining("fedavg", victim.epochs, victim.batch_size, VICTIM_LR, "sgd", shuffle=True)
    result = train_client(0, model, data, training, [], torch.Generator().manual_seed(seed))
    assert result.update is not None
    assert result.update.metadata["local_steps"] == victim.steps
    obs = Observation(model, result.update, full.input_shape, full.num_classes, training=training)
    return obs, data, training


def label_accuracy(recovered: torch.Tensor | None, truth: torch.Tensor) -> float:
    if recovered is None:
        return float("nan")
    from collections import Counter

    hit = Counter(recovered.tolist()) & Counter(truth.tolist())
    return sum(hit.values()) / len(truth)


def honest_ig_loss(obs: Observation, images: torch.Tensor, labels: torch.Tensor) -> float:
    """IG's matching loss at w_0 against w_0 - w_T (no calibration, so it is the honest loss)."""
    import copy

    from torch.nn import functional as F

    model = copy.deepcopy(obs.model)
    params = [p for n, p in model.named_parameters()]
    grads = torch.autograd.grad(F.cross_entropy(model(images), labels), params)
    target = [-obs.update.tensors[n] for n, _ in model.named_parameters()]
    return float(cosine_distance(list(grads), target))


def run_attack(
    name: str, obs: Observation, truth: ImageDataset, seed: int, options: dict[str, Any]
) -> dict[str, Any]:
    """Run one attack and score it; returns the per-run record."""
    attack = create_attack(name, **options)
    t0 = time.perf_counter()
    rec = attack.reconstruct(obs, generator=torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - t0
    assert rec.images is not None
    scores = score_images(rec.images, truth.images)
    stats = dict(rec.stats)
    if name == "ig":
        assert rec.labels is not None
        stats["matching_loss_honest"] = honest_ig_loss(obs, rec.images, rec.labels)
        stats["matching_loss_calibrated"] = stats["matching_loss_honest"]
    return {
        "attack": name,
        "seed": seed,
        "options": options,
        "seconds": seconds,
        "psnr_mean": scores.psnr_mean,
        "psnr_var": scores.psnr_var,
        "ssim_mean": scores.ssim_mean,
        "fsim_mean": scores.fsim_mean,
        "reconstruction_rate": scores.reconstruction_rate,
        "psnr": list(scores.psnr),
        "label_accuracy": label_accuracy(rec.labels, truth.labels),
        "lsim_honest": stats.get("matching_loss_honest"),
        "lsim_calibrated": stats.get("matching_loss_calibrated"),
        "stats": stats,
    }


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of each metric; PSNR variance both over all images pooled and over seed means."""
    import statistics

    def mean(key: str) -> float:
        return statistics.fmean(float(r[key]) for r in records)

    pooled = [min(p, 100.0) for r in records for p in r["psnr"]]
    seed_means = [r["psnr_mean"] for r in records]
    return {
        "n_seeds": len(records),
        "psnr_mean": mean("psnr_mean"),
        "psnr_var_images": statistics.pvariance(pooled) if len(pooled) > 1 else 0.0,
        "psnr_var_seeds": statistics.pvariance(seed_means) if len(seed_means) > 1 else 0.0,
        "ssim_mean": mean("ssim_mean"),
        "fsim_mean": mean("fsim_mean"),
        "reconstruction_rate": mean("reconstruction_rate"),
        "label_accuracy": mean("label_accuracy"),
        "lsim_honest": mean("lsim_honest"),
        "lsim_calibrated": mean("lsim_calibrated"),
        "seconds": mean("seconds"),
    }

"""Malicious-server linear leakage on MedMNIST: Robbing the Fed, LOKI (and Scale-MIA), undefended.

Setting (paper 000, "Key experimental results"): OrganAMNIST, PneumoniaMNIST and the offline PathMNIST test
subset; 100 label-skew clients holding at most 5 classes; first-round updates of paper 000's classifier
(``aegis_cnn`` at its seeded initialisation) with an imprint block of k = 1024 bins; each sampled client
trains on its first B = 64 samples. Paper 000's local recipe is FedAvg, E = 3 epochs, Adam lr 1e-3; we run
it and, beside it, the recipes the plain analytic recovery can read (FedSGD, SGD) so that every number
names the optimiser and the local steps it was measured under:

    rtf/fedsgd            one gradient on B = 64 (the textbook setting)
    rtf/sgd-e1, -e3, -e10 FedAvg, SGD lr 1e-3, 1, 3 or 10 full-batch steps
    rtf/adam-e1, adam-e3  FedAvg, Adam lr 1e-3 (paper 000's recipe for E = 3), plain imprint
    rtf-adam/adam-e1,-e3,-e10  the same with the imprint tuned for Adam (gradients below Adam's eps)
    rtf-adam/adam-e3 all client data   ... on the client's whole label-skew share (B = 64, several
                          mini-batches per epoch: more samples than the 64 per update elsewhere)
    loki/...              LOKI, one slot per sampled client, recovery from the secure-aggregation SUM only
    scale_mia/...         Scale-MIA, imprint in the latent space of an autoencoder trained on public data

PathMNIST: only 718 test images exist offline, so 512 of them (seeded) are split label-skew over 8 clients
and the other 206 are the server's public data; elsewhere the public data are the first 1000 test images
and the clients come from the train split. Public data never overlap client data.

Metrics per regime, pooled over all evaluated client images: reconstruction rate (PSNR > 18 dB after
Hungarian matching), mean PSNR (capped at 100 dB) and SSIM over all matched images and over the successful
subset, and the recovery time for one update as a ratio to one local training step of the same client.
Beside the paper's RR (PSNR > 18 dB) we report ``rr_beyond_prior`` (ours): the share of images whose
reconstruction is above 18 dB *and* at least ``PRIOR_MARGIN_DB`` above the PSNR of the public mean image
against the same image, i.e. the server learned more than the public data already told it. On homogeneous
modalities the mean image alone clears 18 dB for many images (``mean_image_rr_floor``), and a reconstruction
that averages a bin's images tends to that mean, so RR at 18 dB cannot fall below about that floor.
``rr_beyond_class_prior`` (ours) is the same test against the public mean image *of the image's own class*
(the server's labelled public data): on data sets whose classes look very different (PathMNIST: adipose
tissue is nearly white) a class-typical image, e.g. a bin filled with Aegis' same-label synthetic images,
clears the global prior without telling the server anything about the individual client image.

    python benchmarks/linear_leakage.py --scale smoke|small|paper [--seed S] [--datasets organamnist ...]
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.data import ImageDataset, load_dataset, partition
from gradleak.fl import derive_seed, secure_sum, server_view
from gradleak.fl.client import ClientResult, train_client
from gradleak.metrics import psnr, score_images
from gradleak.metrics.floors import class_means, class_prior_images
from gradleak.models import build_model
from gradleak.types import LocalTraining, Observation

from _common import configure_torch, make_parser, parse_args, summarize, write_result

NAME = "linear_leakage"
MODEL = "aegis_cnn"
NUM_CLIENTS = 100
MAX_CLASSES = 5
BATCH = 64
BINS = 1024
PUBLIC_LIMIT = 1000
PATH_CLIENT_POOL, PATH_CLIENTS = 512, 8
THRESHOLD_DB = 18.0
PRIOR_MARGIN_DB = 3.0  # "beyond the prior": at most half the public mean image's MSE

PAPER_RTF = {  # paper 000, Table 2 (Robbing the Fed, no defense): RR %, PSNR dB, SSIM
    "organamnist": {"rr_percent": 82.81, "psnr": 50.60, "ssim": 0.89},
    "pathmnist": {"rr_percent": 78.13, "psnr": 45.20, "ssim": 0.86},
    "pneumoniamnist": None,  # not reported (paper 000 uses ChestMNIST: 89.06 %, 62.40 dB, 0.94)
}

FEDSGD = LocalTraining(protocol="fedsgd", batch_size=BATCH)


def fedavg(optimizer: str, epochs: int) -> LocalTraining:
    return LocalTraining("fedavg", epochs=epochs, batch_size=BATCH, lr=1e-3, optimizer=optimizer)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Regime:
    name: str
    attack: str
    options: dict[str, Any]
    training: LocalTraining
    aggregated: bool = False
    max_samples: int | None = BATCH  # each client's first samples; None: all of its data


def regimes(n_clients: int) -> list[Regime]:
    loki = {"slots": n_clients, "bins_per_slot": BINS}
    smia = {"num_bins": BINS, "autoencoder": "pca", "latent_dim": 256}
    return [
        Regime("rtf/fedsgd", "robbing_the_fed", {"num_bins": BINS}, FEDSGD),
        Regime("rtf/sgd-e1", "robbing_the_fed", {"num_bins": BINS}, fedavg("sgd", 1)),
        Regime("rtf/sgd-e3", "robbing_the_fed", {"num_bins": BINS}, fedavg("sgd", 3)),
        Regime("rtf/adam-e1", "robbing_the_fed", {"num_bins": BINS}, fedavg("adam", 1)),
        Regime("rtf/adam-e3 (paper recipe)", "robbing_the_fed", {"num_bins": BINS}, fedavg("adam", 3)),
        Regime(
            "rtf-adam/adam-e1", "robbing_the_fed", {"num_bins": BINS, "tuned_for": "adam"}, fedavg("adam", 1)
        ),
        Regime(
            "rtf-adam/adam-e3 (paper recipe)",
            "robbing_the_fed",
            {"num_bins": BINS, "tuned_for": "adam"},
            fedavg("adam", 3),
        ),  # fmt: skip
        Regime("loki/fedsgd secagg", "loki", loki, FEDSGD, aggregated=True),
        Regime("loki/sgd-e3 secagg", "loki", loki, fedavg("sgd", 3), aggregated=True),
        Regime(
            "loki-adam/adam-e3 secagg (paper recipe)",
            "loki",
            {**loki, "tuned_for": "adam"},
            fedavg("adam", 3),
            aggregated=True,
        ),  # fmt: skip
        Regime("rtf/sgd-e10", "robbing_the_fed", {"num_bins": BINS}, fedavg("sgd", 10)),
        Regime(
            "rtf-adam/adam-e10",
            "robbing_the_fed",
            {"num_bins": BINS, "tuned_for": "adam"},
            fedavg("adam", 10),
        ),
        Regime(
            "rtf-adam/adam-e3 all client data",
            "robbing_the_fed",
            {"num_bins": BINS, "tuned_for": "adam"},
            fedavg("adam", 3),
            max_samples=None,
        ),  # fmt: skip
        Regime("scale_mia/fedsgd", "scale_mia", smia, FEDSGD),
        Regime("scale_mia/sgd-e3", "scale_mia", smia, fedavg("sgd", 3)),
        Regime(
            "scale_mia-adam/adam-e3 (paper recipe)",
            "scale_mia",
            {**smia, "tuned_for": "adam"},
            fedavg("adam", 3),
        ),  # fmt: skip
    ]


@dataclass(frozen=True)
class Scale:
    clients: int  # sampled clients attacked per dataset (LOKI: all of them in one aggregate)
    datasets: tuple[str, ...] = ("organamnist", "pathmnist", "pneumoniamnist")


SCALES = {"smoke": Scale(clients=2), "small": Scale(clients=5), "paper": Scale(clients=10)}


@dataclass
class RegimeResult:
    regime: str
    attack: str
    options: dict[str, Any]
    local_training: dict[str, Any]
    aggregated: bool
    images: int = 0
    matched: int = 0
    psnr: list[float] = field(default_factory=list)  # per matched image, capped at 100 dB
    ssim: list[float] = field(default_factory=list)
    prior_psnr: list[float] = field(default_factory=list)  # public mean image vs the same matched images
    class_prior_psnr: list[float] = field(default_factory=list)  # public mean of the image's class, ditto
    recovery_seconds: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    prepare_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ok = [i for i, p in enumerate(self.psnr) if p > THRESHOLD_DB]
        beyond = [i for i in ok if self.psnr[i] > self.prior_psnr[i] + PRIOR_MARGIN_DB]
        has_class = len(self.class_prior_psnr) == len(self.psnr)
        beyond_class = [
            i for i in ok if has_class and self.psnr[i] > self.class_prior_psnr[i] + PRIOR_MARGIN_DB
        ]
        mean = lambda xs: float(statistics.fmean(xs)) if xs else None  # noqa: E731
        rec, step = statistics.median(self.recovery_seconds), statistics.median(self.step_seconds)
        return {
            "regime": self.regime, "attack": self.attack, "options": self.options,
            "local_training": self.local_training, "aggregated": self.aggregated,
            "images": self.images, "matched": self.matched,
            "reconstruction_rate": len(ok) / max(1, self.images),
            "rr_beyond_prior": len(beyond) / max(1, self.images), "prior_margin_db": PRIOR_MARGIN_DB,
            "rr_beyond_class_prior": len(beyond_class) / max(1, self.images) if has_class else None,
            "psnr_mean_all": mean(self.psnr), "ssim_mean_all": mean(self.ssim),
            "psnr_mean_successful": mean([self.psnr[i] for i in ok]),
            "ssim_mean_successful": mean([self.ssim[i] for i in ok]),
            "recovery_seconds": summarize(self.recovery_seconds),
            "local_step_seconds": summarize(self.step_seconds),
            "recovery_over_step": rec / step, "prepare_seconds": self.prepare_seconds,
            "per_image_psnr": [round(v, 3) for v in self.psnr],
            "per_image_ssim": [round(v, 4) for v in self.ssim],
            "per_image_prior_psnr": [round(v, 3) for v in self.prior_psnr],
            "per_image_class_prior_psnr": [round(v, 3) for v in self.class_prior_psnr], "notes": self.notes,
        }  # fmt: skip


def client_pool(
    name: str, seed: int
) -> tuple[ImageDataset, list[np.ndarray], torch.Tensor, np.random.Generator]:
    """The clients' pool, its label-skew client index sets, the server's public images, and the setting's
    generator (advanced past the PathMNIST split) that :func:`load_setting` samples the clients with."""
    rng = np.random.default_rng(derive_seed(seed, 0x11EA))
    if name == "pathmnist":
        full = load_dataset(name, "test")
        perm = rng.permutation(len(full))
        pool = full.subset(np.sort(perm[:PATH_CLIENT_POOL]))
        public = full.images[np.sort(perm[PATH_CLIENT_POOL:])]
        total = PATH_CLIENTS
    else:
        pool = load_dataset(name, "train")
        public = load_dataset(name, "test", limit=PUBLIC_LIMIT).images
        total = NUM_CLIENTS
    parts = partition(
        "label_skew", pool, total, derive_seed(seed, 0x9A27), max_classes_per_client=MAX_CLASSES
    )
    return pool, list(parts), public, rng


def load_setting(
    name: str, seed: int, n_clients: int
) -> tuple[list[ImageDataset], torch.Tensor, dict[str, Any]]:
    """The sampled clients' full data and the server's public images."""
    pool, parts, public, rng = client_pool(name, seed)
    total = len(parts)
    ids = sorted(int(i) for i in rng.choice(total, size=min(n_clients, total), replace=False))
    clients = [pool.subset(np.sort(parts[i])) for i in ids]
    info = {"client_ids": ids, "client_full_sizes": [len(c) for c in clients], "public_images": len(public),
            "num_clients": total, "pool": len(pool)}  # fmt: skip
    return clients, public, info


def public_labelled(name: str, seed: int) -> ImageDataset:
    """The server's public images of :func:`load_setting` with their labels."""
    if name == "pathmnist":
        full = load_dataset(name, "test")
        perm = np.random.default_rng(derive_seed(seed, 0x11EA)).permutation(len(full))
        return full.subset(np.sort(perm[PATH_CLIENT_POOL:]))
    return load_dataset(name, "test", limit=PUBLIC_LIMIT)


def run_regime(
    regime: Regime,
    model: nn.Module,
    clients: Sequence[ImageDataset],
    public: torch.Tensor,
    seed: int,
    public_labels: torch.Tensor | None = None,
) -> RegimeResult:
    attack = create_attack(regime.attack, **regime.options)
    out = RegimeResult(regime.name, regime.attack, regime.options, asdict(regime.training), regime.aggregated)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(derive_seed(seed, 0xBAD))
    broadcast, secrets = attack.prepare(copy.deepcopy(model), public, generator=gen)  # type: ignore[attr-defined]
    out.prepare_seconds = time.perf_counter() - t0
    shape, classes = clients[0].input_shape, clients[0].num_classes
    results = []
    if regime.max_samples is not None:
        clients = [c.subset(np.arange(min(regime.max_samples, len(c)))) for c in clients]
    for slot, data in enumerate(clients):
        sent = attack.customize(broadcast, slot) if hasattr(attack, "customize") else broadcast  # type: ignore[attr-defined]
        gen = torch.Generator().manual_seed(derive_seed(seed, 0xC11E, slot))
        t0 = time.perf_counter()
        res = train_client(slot, sent, data, regime.training, [], gen)
        steps = int(res.update.metadata.get("local_steps", 1)) if res.update is not None else 1  # type: ignore[call-overload]
        out.step_seconds.append((time.perf_counter() - t0) / steps)
        results.append(res)
    images = [c.images for c in clients]
    return score_regime(
        out, attack, broadcast, secrets, results, images, shape, classes, regime.aggregated, seed, public,
        public_labels,
    )  # fmt: skip


def score_regime(
    out: RegimeResult,
    attack: Any,
    broadcast: nn.Module,
    secrets: Mapping[str, object],
    results: Sequence[ClientResult],
    client_images: Sequence[torch.Tensor],
    shape: tuple[int, ...],
    classes: int,
    aggregated: bool,
    seed: int,
    public: torch.Tensor,
    public_labels: torch.Tensor | None = None,
) -> RegimeResult:
    """The server's view of ``results`` (one update each, or their secure sum), the attack on it, and the
    scores against the clients' images, accumulated into ``out`` (with the public mean image's PSNR against
    each matched image, the prior the server had before the attack; given ``public_labels``, also the PSNR
    of the public mean image of the matched image's class, the global mean for a class public data lack)."""
    prior = public.float().mean(0, keepdim=True)
    means = None
    if public_labels is not None:
        means = class_means(public, public_labels)
    labels = [r.truth.labels for r in results]  # type: ignore[union-attr]
    if aggregated:
        agg = secure_sum([r.update for r in results])  # type: ignore[misc]
        observations = [Observation(broadcast, agg, shape, classes, secrets=secrets, aggregated=True,
                                    num_clients=len(results))]  # fmt: skip
        truths = [torch.cat(list(client_images))]
        labels = [torch.cat(labels)]
    else:
        observations = server_view(broadcast, results, input_shape=shape, num_classes=classes,
                                   secure_aggregation=False, training=None, secrets=secrets)  # fmt: skip
        truths = [r.truth.images for r in results]  # type: ignore[union-attr]
    for k, (obs, truth, label) in enumerate(zip(observations, truths, labels, strict=True)):
        t0 = time.perf_counter()
        rec = attack.reconstruct(obs, generator=torch.Generator().manual_seed(derive_seed(seed, 0xA77C, k)))
        out.recovery_seconds.append(time.perf_counter() - t0)
        assert rec.images is not None
        scores = score_images(rec.images, truth)
        out.images += scores.n_images
        out.matched += scores.n_matched
        out.psnr += [min(p, 100.0) for p in scores.psnr]
        out.ssim += list(scores.ssim)
        hit = torch.tensor(scores.matching) >= 0
        matched = truth[hit].float()
        out.prior_psnr += psnr(prior.expand_as(matched), matched).clamp(max=100.0).tolist()
        if means is not None:
            own = class_prior_images(means, label[hit], prior)
            out.class_prior_psnr += psnr(own, matched).clamp(max=100.0).tolist()
    return out


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=None, help="subset of the three data sets")
    parser.add_argument("--regimes", nargs="+", default=None, help="regime name prefixes to run")
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    datasets = tuple(args.datasets or scale.datasets)
    threads = configure_torch(args.threads)
    print(f"{NAME} --scale {args.scale}: {scale}, seeds {args.seeds}, torch threads {threads}", flush=True)
    per_dataset: dict[str, Any] = {}
    for seed in args.seeds:
        for name in datasets:
            clients, public, info = load_setting(name, seed, scale.clients)
            public_labels = public_labelled(name, seed).labels
            model = build_model(
                MODEL, clients[0].input_shape, clients[0].num_classes, seed=derive_seed(seed, 0x30DE)
            )
            rows = []
            for regime in regimes(len(clients)):
                if args.regimes and not any(regime.name.startswith(p) for p in args.regimes):
                    continue
                s = run_regime(regime, model, clients, public, seed, public_labels).summary()
                rows.append(s)
                print(f"  seed {seed} {name:15s} {regime.name:42s} RR {s['reconstruction_rate']:.3f} "
                      f"PSNR {fmt(s['psnr_mean_all'], '.1f')} SSIM {fmt(s['ssim_mean_all'], '.3f')} | "
                      f"successful PSNR {fmt(s['psnr_mean_successful'], '.1f')} "
                      f"SSIM {fmt(s['ssim_mean_successful'], '.3f')} | recovery/step "
                      f"{s['recovery_over_step']:.3f}", flush=True)  # fmt: skip
            per_dataset[f"{name}/seed{seed}"] = {"setting": info, "paper_robbing_the_fed": PAPER_RTF[name],
                                                 "regimes": rows}  # fmt: skip
    payload = {
        "setting": {
            "model": MODEL, "bins": BINS, "batch": BATCH, "threshold_db": THRESHOLD_DB,
            "partition": {"name": "label_skew", "num_clients": NUM_CLIENTS,
                          "max_classes_per_client": MAX_CLASSES,
                          "pathmnist": f"{PATH_CLIENT_POOL} of 718 test images over {PATH_CLIENTS} clients"},
            "public": f"first {PUBLIC_LIMIT} test images (pathmnist: the 206 test images clients lack)",
            "round": "first round (seeded initial weights)", "clients_per_dataset": scale.clients,
            "psnr_cap_db": 100.0,
        },
        "results": per_dataset,
    }  # fmt: skip
    path = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

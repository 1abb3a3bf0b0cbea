"""Paper 000 Table 2 / Table A.5 analogue: Aegis vs no defense under Robbing the Fed (and LOKI, Scale-MIA).

Protocol and helpers from ``benchmarks/linear_leakage.py`` (paper 000's setting: 100 label-skew clients with
at most 5 classes, first-round updates of ``aegis_cnn`` with a k = 1024 imprint block, B = 64, E = 3; each
attacked client trains on its first 64 samples). Every client builds its own Aegis cache offline: the
built-in per-class PCA-Gaussian generator fit on the client's whole label-skew share (its sanctioned split),
candidates accepted by the feature-space budget H (``defenses/aegis_cache.py``). Local optimisers, each
number labelled with its setting:

    rtf/sgd-e3              FedAvg, SGD lr 1e-3, E = 3 (the plain attack reads SGD deltas)
    rtf-adam/adam-e3        FedAvg, Adam lr 1e-3, E = 3 (paper 000's recipe), Adam-tuned imprint
    rtf-all, rtf-adam-all   the same, but the attack returns every non-empty bin (up to k) instead of the
                            ``num_samples`` bins of largest mass, and matching picks the best per image: an
                            upper bound on what the attack can leak when synthetic bins outnumber real ones
    loki-adam/adam-e3       LOKI (Adam-tuned), secure-aggregation sum of the sampled clients
    scale_mia-adam/adam-e3  Scale-MIA (PCA-256 autoencoder, Adam-tuned)
    loki-adam-all, smia-adam-all  the same with every non-empty bin returned (LOKI: every slot's bins,
                            through the benchmark-only ``bench-loki-all-bins`` read-out below)

Defenses: ``none``; ``aegis`` (lambda weighting, the default) and ``aegis-same_lr``; ``--sweep`` adds
M in {512, 1024, 1536, 2048} (Table A.5; lambda weighting) and writes ``aegis_tableA5_<scale>.json``.

``--generator-data public`` fits the generator on the server's public images instead of the client's share
(an off-the-shelf-generator analogue); ``--generator-data oracle`` uses no generator but real images the
client does not hold (``oracle_cache``: other clients' images, public ones on PathMNIST), a diagnostic of
what a perfect in-distribution generator would give, not a defense.

Besides RR (paper 000's 18 dB rule) every row has ``rr_beyond_prior`` and ``rr_beyond_class_prior``
(``linear_leakage.py``: 3 dB above the public mean image, or above the public mean image of the image's own
class), and each data set its floors: ``mean_image_rr_floor``, ``class_mean_rr_floor`` and ``cache_floor``
(the three rates of B random cache images per client, no update and no attack; per M).

    python benchmarks/aegis_table2.py --scale smoke|small|paper --threads 1 [--sweep] [--attacks rtf ...]
        [--components 32 --tag NAME]
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.attacks.linear.loki import Loki, LokiConfig
from gradleak.data import ImageDataset
from gradleak.defenses.aegis_cache import CacheConfig, SyntheticCache, build_cache
from gradleak.defenses.aegis_synthetic import aegis_for_client
from gradleak.fl import derive_seed
from gradleak.fl.client import train_client
from gradleak.generators import ClassGaussianGenerator, GaussianGeneratorConfig
from gradleak.metrics import psnr, score_images
from gradleak.metrics.floors import class_means, class_prior_images
from gradleak.models import build_model
from gradleak.registry import ATTACKS
from gradleak.types import Observation, Reconstruction, Update
from linear_leakage import (
    BATCH,
    BINS,
    MODEL,
    PAPER_RTF,
    THRESHOLD_DB,
    Regime,
    RegimeResult,
    client_pool,
    fedavg,
    fmt,
    load_setting,
    public_labelled,
    score_regime,
)

from _common import configure_torch, make_parser, parse_args, summarize, write_result

NAME = "aegis_table2"
M_DEFAULT = 2048
SWEEP = (512, 1024, 1536, 2048)
PAPER_AEGIS = {  # paper 000 Table 2 (Aegis, M = 2048, Robbing the Fed): RR %, PSNR, SSIM, succ. PSNR/SSIM
    "organamnist": {"rr_percent": 11.63, "psnr": 20.10, "ssim": 0.51, "psnr_succ": 31.40, "ssim_succ": 0.88},
    "pathmnist": {"rr_percent": 9.38, "psnr": 17.30, "ssim": 0.38, "psnr_succ": 27.90, "ssim_succ": 0.84},
    "pneumoniamnist": None,  # ChestMNIST in the paper: 9.50 %, 18.70 dB, 0.46 (succ. 29.80 dB, 0.91)
}
PAPER_SWEEP_RR = {  # paper 000 Table A.5, RR % for M = 512, 1024, 1536, 2048
    "organamnist": [47.82, 27.31, 17.66, 11.63],
    "pathmnist": [44.34, 24.53, 15.21, 9.38],
    "pneumoniamnist": None,  # ChestMNIST: 49.95, 27.03, 16.24, 9.50
}
SMIA = {"num_bins": BINS, "autoencoder": "pca", "latent_dim": 256, "tuned_for": "adam"}
SCALES = {"smoke": 2, "small": 5, "paper": 10}


class LokiAllBins(Loki):
    """LOKI's attacker returning every non-empty bin of every slot (its read-out keeps the ``num_samples``
    bins of largest mass): the all-bins read-out, as ``max_images = k`` for the other two attacks."""

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        every = self.config.slots * self.config.bins_per_slot
        upd = obs.update
        wide = Update(upd.tensors, every, upd.kind, upd.metadata)
        return super().reconstruct(dataclasses.replace(obs, update=wide), generator=generator)


if "bench-loki-all-bins" not in ATTACKS:
    ATTACKS.register("bench-loki-all-bins", LokiAllBins, config_cls=LokiConfig, summary="benchmark only")


def attack_regimes(n_clients: int) -> dict[str, Regime]:
    return {
        "rtf": Regime("rtf/sgd-e3", "robbing_the_fed", {"num_bins": BINS}, fedavg("sgd", 3)),
        "rtf-adam": Regime(
            "rtf-adam/adam-e3 (paper recipe)",
            "robbing_the_fed",
            {"num_bins": BINS, "tuned_for": "adam"},
            fedavg("adam", 3),
        ),
        "rtf-all": Regime(
            "rtf/sgd-e3, all bins returned",
            "robbing_the_fed",
            {"num_bins": BINS, "max_images": BINS},
            fedavg("sgd", 3),
        ),
        "rtf-adam-all": Regime(
            "rtf-adam/adam-e3, all bins returned",
            "robbing_the_fed",
            {"num_bins": BINS, "tuned_for": "adam", "max_images": BINS},
            fedavg("adam", 3),
        ),
        "loki-adam": Regime(
            "loki-adam/adam-e3 secagg (paper recipe)",
            "loki",
            {"slots": n_clients, "bins_per_slot": BINS, "tuned_for": "adam"},
            fedavg("adam", 3),
            aggregated=True,
        ),
        "smia-adam": Regime("scale_mia-adam/adam-e3 (paper recipe)", "scale_mia", SMIA, fedavg("adam", 3)),
        "loki-adam-all": Regime(
            "loki-adam/adam-e3 secagg, all bins returned",
            "bench-loki-all-bins",
            {"slots": n_clients, "bins_per_slot": BINS, "tuned_for": "adam"},
            fedavg("adam", 3),
            aggregated=True,
        ),
        "smia-adam-all": Regime(
            "scale_mia-adam/adam-e3, all bins returned",
            "scale_mia",
            {**SMIA, "max_images": BINS},
            fedavg("adam", 3),
        ),
    }


def client_cache(
    share: ImageDataset,
    size: int,
    seed: int,
    slot: int,
    fit_on: ImageDataset | None = None,
    generator_config: GaussianGeneratorConfig | None = None,
) -> SyntheticCache:
    """The client's offline cache: generator fit on its whole share (or on ``fit_on``, e.g. public data,
    the analogue of an off-the-shelf generator), acceptance against the client's share."""
    t0 = time.perf_counter()
    source = ClassGaussianGenerator.fit(share if fit_on is None else fit_on, generator_config)
    fit = time.perf_counter() - t0
    cache = build_cache(
        source,
        share,
        CacheConfig(size=size),
        generator=torch.Generator().manual_seed(derive_seed(seed, 0xCAC4E, slot)),
    )
    cache.stats["generator_fit_seconds"] = fit
    return cache


def other_clients(pool: ImageDataset, part: np.ndarray) -> torch.Tensor:
    """Pool indices of the images of ``part``'s labels that other clients hold."""
    others = torch.as_tensor(np.setdiff1d(np.arange(len(pool.labels)), part))
    return others[torch.isin(pool.labels[others], torch.unique(pool.labels[torch.as_tensor(part)]))]


def oracle_cache(
    source: ImageDataset, share: ImageDataset, size: int, seed: int, slot: int
) -> SyntheticCache:
    """A *perfect generator*'s cache (a diagnostic, not a defense): ``size`` real images of ``source``, a set
    the client does not hold (other clients' images, or public ones), of the share's labels, drawn at the
    share's label frequencies (as ``build_cache`` draws labels); distinct while ``source`` has enough
    (``stats["distinct"]``). Separates what Aegis' extra step costs from what generated images cost."""
    t0 = time.perf_counter()
    labels = torch.unique(share.labels)
    idx = torch.nonzero(torch.isin(source.labels, labels)).flatten()
    counts = torch.bincount(share.labels, minlength=share.num_classes).double()
    available = torch.bincount(source.labels[idx], minlength=share.num_classes).double()
    weight = counts[source.labels[idx]] / available[source.labels[idx]]
    g = torch.Generator().manual_seed(derive_seed(seed, 0x0AC1E, slot))
    pick = idx[torch.multinomial(weight, size, replacement=size > len(idx), generator=g)]
    stats = {"seconds": time.perf_counter() - t0, "generator_fit_seconds": 0.0, "rejection_rate": 0.0}
    stats["distinct"] = float(len(torch.unique(pick)))
    return SyntheticCache(source.images[pick].contiguous(), source.labels[pick], stats)


def oracle_caches(
    name: str, seed: int, shares: Sequence[ImageDataset], ids: Sequence[int], public: ImageDataset
) -> list[SyntheticCache]:
    """:func:`oracle_cache` for the sampled clients ``ids`` of :func:`load_setting`: other clients' images
    of the pool, except on PathMNIST, whose 512-image pool is too small, the public labelled images."""
    pool, parts, _, _ = client_pool(name, seed)
    return [
        oracle_cache(
            public if name == "pathmnist" else pool.subset(other_clients(pool, parts[i]).numpy()),
            share,
            M_DEFAULT,
            seed,
            slot,
        )
        for slot, (i, share) in enumerate(zip(ids, shares, strict=True))
    ]


def mean_image_floor(shares: Sequence[ImageDataset], public: torch.Tensor) -> float:
    """RR of a trivial "attack" that returns the public mean image for every client image: the share of
    attacked images within 18 dB of it (where RR at 18 dB cannot tell a reconstruction from the mean)."""
    truth = torch.cat([s.images[:BATCH] for s in shares])
    mse = (truth - public.mean(0, keepdim=True)).pow(2).flatten(1).mean(1)
    return float((10 * torch.log10(1 / mse.clamp_min(1e-12)) > THRESHOLD_DB).float().mean())


def class_mean_floor(shares: Sequence[ImageDataset], public: ImageDataset) -> float:
    """As :func:`mean_image_floor` with the public mean image of each client image's own class."""
    means = class_means(public.images, public.labels)
    glob = public.images.float().mean(0, keepdim=True)
    truth = torch.cat([s.images[:BATCH] for s in shares])
    labels = torch.cat([s.labels[:BATCH] for s in shares])
    own = class_prior_images(means, labels, glob)
    return float((psnr(own, truth) > THRESHOLD_DB).float().mean())


def cache_floor(
    shares: Sequence[ImageDataset],
    caches: Sequence[SyntheticCache],
    public: ImageDataset,
    seed: int,
    size: int,
) -> dict[str, float]:
    """A "reconstruction" without any update: each client's B images scored (Hungarian matching, as the
    attack) against B cache images drawn at random from the first ``size``. What the three RR rules give
    for images that carry no information about the client's data beyond what the generator was fit on."""
    out = RegimeResult("cache floor", "none", {}, {}, False)
    means = class_means(public.images, public.labels)
    glob = public.images.float().mean(0, keepdim=True)
    for slot, (share, cache) in enumerate(zip(shares, caches, strict=True)):
        truth, labels = share.images[:BATCH], share.labels[:BATCH]
        pick = torch.randperm(size, generator=torch.Generator().manual_seed(derive_seed(seed, 0xF100, slot)))
        scores = score_images(cache.images[pick[: len(truth)]], truth)
        hit = torch.tensor(scores.matching) >= 0
        out.images += scores.n_images
        out.psnr += [min(p, 100.0) for p in scores.psnr]
        out.ssim += list(scores.ssim)
        out.prior_psnr += psnr(glob.expand_as(truth[hit]), truth[hit]).tolist()
        out.class_prior_psnr += psnr(class_prior_images(means, labels[hit], glob), truth[hit]).tolist()
    out.recovery_seconds, out.step_seconds = [0.0], [1.0]
    s = out.summary()
    return {k: s[k] for k in ("reconstruction_rate", "rr_beyond_prior", "rr_beyond_class_prior")}


def run_defended(
    regime: Regime,
    model: nn.Module,
    shares: Sequence[ImageDataset],
    caches: Sequence[SyntheticCache] | None,
    aegis: dict[str, Any],
    public: torch.Tensor,
    seed: int,
    public_labels: torch.Tensor | None = None,
) -> RegimeResult:
    """``linear_leakage.run_regime`` with a per-client Aegis defense (``caches`` None: undefended)."""
    attack = create_attack(regime.attack, **regime.options)
    out = RegimeResult(regime.name, regime.attack, regime.options, asdict(regime.training), regime.aggregated)
    t0 = time.perf_counter()
    broadcast, secrets = attack.prepare(
        copy.deepcopy(model),
        public,  # type: ignore[attr-defined]
        generator=torch.Generator().manual_seed(derive_seed(seed, 0xBAD)),
    )
    out.prepare_seconds = time.perf_counter() - t0
    shape, classes = shares[0].input_shape, shares[0].num_classes
    data = [c.subset(np.arange(min(BATCH, len(c)))) for c in shares]
    results = []
    for slot, d in enumerate(data):
        sent = attack.customize(broadcast, slot) if hasattr(attack, "customize") else broadcast  # type: ignore[attr-defined]
        defenses = [] if caches is None else [aegis_for_client(caches[slot], **aegis)]
        t0 = time.perf_counter()
        res = train_client(
            slot,
            sent,
            d,
            regime.training,
            defenses,
            torch.Generator().manual_seed(derive_seed(seed, 0xC11E, slot)),
        )
        if res.update is None:
            raise RuntimeError(f"client {slot} withheld its update: {res.error}")
        out.step_seconds.append(time.perf_counter() - t0)  # here: the client's whole local training
        results.append(res)
    images = [d.images for d in data]
    return score_regime(
        out, attack, broadcast, secrets, results, images, shape, classes, regime.aggregated, seed, public,
        public_labels,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["organamnist", "pathmnist", "pneumoniamnist"])
    parser.add_argument(
        "--attacks",
        nargs="+",
        default=["rtf", "rtf-adam"],
        help="rtf rtf-adam loki-adam smia-adam, each also with -all (every bin returned)",
    )
    parser.add_argument("--sweep", action="store_true", help="Table A.5: M in 512..2048")
    parser.add_argument("--same-lr", action="store_true", help="also run the same-lr normalisation")
    parser.add_argument(
        "--generator-data",
        choices=["share", "public", "oracle"],
        default="share",
        help="fit the generator on the client's share (default) or on the public test images; oracle: "
        "no generator, real images the client does not hold (a diagnostic, not a defense)",
    )
    parser.add_argument(
        "--components",
        type=int,
        default=GaussianGeneratorConfig.components,
        help="PCA directions per class of the built-in cache generator",
    )
    parser.add_argument("--tag", default="", help="suffix of the result file name")
    parser.add_argument("--no-baseline", action="store_true", help="skip the undefended rows")
    args = parse_args(parser, argv)
    n_clients = SCALES[args.scale]
    gen = GaussianGeneratorConfig(components=args.components)
    threads = configure_torch(args.threads)
    print(
        f"{NAME} --scale {args.scale}: {n_clients} clients, seeds {args.seeds}, threads {threads}", flush=True
    )
    defenses: list[tuple[str, int | None, dict[str, Any]]] = [("none", None, {}), ("aegis", M_DEFAULT, {})]
    if args.no_baseline:
        defenses = defenses[1:]
    if args.same_lr:
        defenses.append(("aegis-same_lr", M_DEFAULT, {"normalization": "same_lr"}))
    if args.sweep:
        defenses += [(f"aegis-M{m}", m, {"cache": {"size": m}}) for m in SWEEP if m != M_DEFAULT]
    per: dict[str, Any] = {}
    for seed in args.seeds:
        for name in args.datasets:
            shares, public, info = load_setting(name, seed, n_clients)
            model = build_model(
                MODEL, shares[0].input_shape, shares[0].num_classes, seed=derive_seed(seed, 0x30DE)
            )
            labelled = public_labelled(name, seed)
            fit_on = labelled if args.generator_data == "public" else None
            if args.generator_data == "oracle":
                caches = oracle_caches(name, seed, shares, info["client_ids"], labelled)
            else:
                caches = [client_cache(s, M_DEFAULT, seed, i, fit_on, gen) for i, s in enumerate(shares)]
            info["mean_image_rr_floor"] = mean_image_floor(shares, public)
            info["class_mean_rr_floor"] = class_mean_floor(shares, labelled)
            info["cache"] = [c.stats for c in caches]
            info["cache_floor"] = {
                str(m): cache_floor(shares, caches, labelled, seed, m)
                for m in sorted({m for _, m, _ in defenses if m is not None})
            }
            print(
                f"  {name}: mean-image floor {info['mean_image_rr_floor']:.3f}, class-mean floor "
                f"{info['class_mean_rr_floor']:.3f}, cache floor {info['cache_floor']}",
                flush=True,
            )
            rows = []
            for key in args.attacks:
                regime = attack_regimes(len(shares))[key]
                for label, m, opts in defenses:
                    res = run_defended(
                        regime, model, shares, None if m is None else caches, opts, public, seed,
                        labelled.labels,
                    )  # fmt: skip
                    s = res.summary()
                    s.update(
                        defense=label,
                        cache_size=m,
                        aegis_options=opts,
                        client_seconds=summarize(res.step_seconds),
                    )
                    rows.append(s)
                    print(
                        f"  seed {seed} {name:14s} {regime.name:40s} {label:14s} "
                        f"RR {s['reconstruction_rate']:.3f} (beyond prior {s['rr_beyond_prior']:.3f}, "
                        f"class prior {s['rr_beyond_class_prior']:.3f}) "
                        f"PSNR {fmt(s['psnr_mean_all'], '.1f')} SSIM {fmt(s['ssim_mean_all'], '.3f')} | succ "
                        f"{fmt(s['psnr_mean_successful'], '.1f')} {fmt(s['ssim_mean_successful'], '.3f')} | "
                        f"client {s['client_seconds']['median']:.1f}s",
                        flush=True,
                    )
            per[f"{name}/seed{seed}"] = {
                "setting": info,
                "paper_no_defense": PAPER_RTF[name],
                "paper_aegis": PAPER_AEGIS[name],
                "paper_sweep_rr": PAPER_SWEEP_RR[name],
                "rows": rows,
            }
    payload = {
        "setting": {
            "model": MODEL,
            "bins": BINS,
            "batch": BATCH,
            "cache_default": M_DEFAULT,
            "generator": f"per-class PCA Gaussian ({gen.components} components)"
            if args.generator_data != "oracle"
            else "none: real images the client does not hold (oracle diagnostic)",
            "acceptance": "feature MSE to nearest same-label private sample <= H (q0.9 LOO)",
            "clients_per_dataset": n_clients,
            "round": "first round",
        },
        "results": per,
    }
    name = "aegis_tableA5" if args.sweep else NAME
    if args.generator_data != "share":
        name += f"_{args.generator_data}gen"
    if args.tag:
        name += f"_{args.tag}"
    payload["setting"]["generator_data"] = args.generator_data
    print(f"wrote {write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

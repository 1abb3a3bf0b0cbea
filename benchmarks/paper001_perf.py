"""Paper 001 performance: cost of one PI-SME iteration vs m SME iterations vs a hand-written floor.

Claims checked (ratios measured in one run, on the same model, batch and update):

* one PI-SME iteration with m nodes <= 1.1 x m x one SME iteration (each node is one double backward);
* one SME iteration <= 1.1 x a minimal hand-written PyTorch step doing the same work: weights on the line
  ``alpha w0 + (1 - alpha) wT``, forward, ``autograd.grad(create_graph=True)``, cosine + TV, backward to
  (X, alpha), Adam step (the floor);
* whether batching the m nodes with ``torch.func.vmap`` beats m separate double backwards.

Per-iteration times come from the attacks' own loop (``run_surrogate``'s callback, wall and CPU clocks), the
first ``WARMUP`` iterations dropped; the variants are interleaved over ``repeats`` rounds so that machine
drift hits all alike, and the medians are compared.

    python benchmarks/paper001_perf.py --scale smoke|small|paper [--threads 1]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call
from torch.nn import functional as F

from gradleak.attacks.image.ig import cosine_distance, total_variation
from gradleak.attacks.image.pisme import PISME, PISMEConfig
from gradleak.attacks.image.sme import SME, SMEConfig
from gradleak.attacks.image.surrogate import (
    SurrogateSettings,
    bezier,
    build_problem,
    gauss_legendre,
    images_of,
    run_surrogate,
    weighted_sum,
)
from gradleak.experiments.config import load_config
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, summarize, write_result
from gradleak.experiments.runner import audited_updates
from gradleak.types import Observation

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
CONFIGS = HERE / "configs"
NAME = "paper001_perf"
WARMUP = 2
TARGET = 1.1


@dataclass(frozen=True)
class Scale:
    dataset: str
    k: int
    batch_size: int
    epochs: int
    iterations: int  # per timed call (WARMUP of them dropped)
    repeats: int
    nodes: tuple[int, ...]


SCALES = {
    "smoke": Scale("cifar10", 2, 1, 2, 4, 1, (3,)),
    "small": Scale("cifar10", 10, 2, 20, 8, 3, (3, 7)),
    "paper": Scale("cifar10", 50, 10, 20, 12, 5, (3, 7, 12)),
}


def attack_times(obs: Observation, settings: SurrogateSettings, name: str) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each iteration of the real attack loop (callback timestamps)."""
    stamps: list[tuple[float, float]] = []

    def cb(it: int, info: dict[str, float], x: torch.Tensor) -> None:
        stamps.append((time.perf_counter(), time.process_time()))

    t0 = (time.perf_counter(), time.process_time())
    run_surrogate(obs, settings, generator=torch.Generator().manual_seed(0), attack=name, callback=cb)
    marks = [t0, *stamps]
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:], strict=False)][WARMUP:]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False)][WARMUP:]
    return wall, cpu


def floor_times(obs: Observation, iterations: int) -> tuple[list[float], list[float]]:
    """The minimal hand-written SME step (same model, batch, update, optimiser and losses)."""
    prob = build_problem(obs, "floor", None)
    model, names, labels = prob.model, prob.names, prob.labels
    w0, wt, target = prob.w0, prob.wt, prob.target
    fixed = prob.fixed
    z = torch.randn(prob.shape, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    alpha = torch.tensor(0.5, requires_grad=True)
    opt = torch.optim.Adam([{"params": [z], "lr": 1.0}, {"params": [alpha], "lr": 1e-2}])
    wall, cpu = [], []
    for _ in range(iterations):
        t = (time.perf_counter(), time.process_time())
        opt.zero_grad(set_to_none=True)
        ws = [alpha * a + (1 - alpha) * b for a, b in zip(w0, wt, strict=True)]
        out = functional_call(model, {**fixed, **dict(zip(names, ws, strict=True))}, (0.5 + 0.25 * z,))
        grads = torch.autograd.grad(F.cross_entropy(out, labels), ws, create_graph=True)
        loss = cosine_distance(list(grads), target) + 1e-2 * total_variation(z)
        loss.backward()
        opt.step()
        with torch.no_grad():
            alpha.clamp_(0, 1)
        wall.append(time.perf_counter() - t[0])
        cpu.append(time.process_time() - t[1])
    return wall[WARMUP:], cpu[WARMUP:]


def vmap_times(obs: Observation, m: int, iterations: int) -> tuple[list[float], list[float], str]:
    """PI-SME's G (Eq. 8) with the m node gradients batched by torch.func.vmap(grad) (no calibration)."""
    prob = build_problem(obs, "vmap", None)
    model, names, labels, fixed = prob.model, prob.names, prob.labels, prob.fixed
    t_nodes, c_nodes = gauss_legendre(m, torch.float32)
    z = torch.randn(prob.shape, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    p1 = [((a + b) / 2).requires_grad_(True) for a, b in zip(prob.w0, prob.wt, strict=True)]
    opt = torch.optim.Adam([{"params": [z], "lr": 1.0}, {"params": p1, "lr": 1e-3}])

    def loss_fn(ws: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, {**fixed, **dict(zip(names, ws, strict=True))}, (x,))
        return F.cross_entropy(out, labels)

    grad_fn = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(0, None))
    wall, cpu = [], []
    try:
        for _ in range(iterations):
            t = (time.perf_counter(), time.process_time())
            opt.zero_grad(set_to_none=True)
            ws = tuple(
                bezier(a.unsqueeze(0), p.unsqueeze(0), b.unsqueeze(0), t_nodes.reshape((m,) + (1,) * a.dim()))
                for a, p, b in zip(prob.w0, p1, prob.wt, strict=True)
            )
            g = grad_fn(ws, images_of(z))
            G = [(c_nodes.reshape((m,) + (1,) * (gi.dim() - 1)) * gi).sum(0) for gi in g]
            loss = cosine_distance(G, prob.target) + 1e-2 * total_variation(z)
            loss.backward()
            opt.step()
            wall.append(time.perf_counter() - t[0])
            cpu.append(time.process_time() - t[1])
    except Exception as exc:  # noqa: BLE001  (report, do not hide)
        return [], [], f"failed: {type(exc).__name__}: {exc}"
    return wall[WARMUP:], cpu[WARMUP:], "ok"


def check_vmap_matches(obs: Observation, m: int) -> float:
    """Max relative difference between the vmap G and the loop G at the same point (correctness)."""
    prob = build_problem(obs, "vmap", None)
    model, names, labels, fixed = prob.model, prob.names, prob.labels, prob.fixed
    x = images_of(torch.randn(prob.shape, generator=torch.Generator().manual_seed(1)))
    t_nodes, c_nodes = gauss_legendre(m, torch.float32)
    mid = [(a + b) / 2 for a, b in zip(prob.w0, prob.wt, strict=True)]
    loop = weighted_sum(
        [float(c) for c in c_nodes],
        [prob.grads([bezier(a, p, b, float(t)).requires_grad_(True) for a, p, b in
                     zip(prob.w0, mid, prob.wt, strict=True)], x, False) for t in t_nodes],
    )  # fmt: skip

    def loss_fn(ws: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.cross_entropy(
            functional_call(model, {**fixed, **dict(zip(names, ws, strict=True))}, (x,)), labels
        )

    ws = tuple(
        bezier(a.unsqueeze(0), p.unsqueeze(0), b.unsqueeze(0), t_nodes.reshape((m,) + (1,) * a.dim()))
        for a, p, b in zip(prob.w0, mid, prob.wt, strict=True)
    )
    g = torch.func.vmap(torch.func.grad(loss_fn))(ws)
    G = [(c_nodes.reshape((m,) + (1,) * (gi.dim() - 1)) * gi).sum(0) for gi in g]
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(G, loop, strict=True)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    threads = configure_torch(args.threads if args.threads is not None else 1)
    print(f"{NAME} --scale {args.scale}: {scale}, threads {threads}", flush=True)
    victim = [f"data.dataset='{scale.dataset}'", f"audit.max_samples={scale.k}", "audit.clients=1",
              f"audit.training.batch_size={scale.batch_size}", f"audit.training.epochs={scale.epochs}",
              f"experiment.seed={args.seeds[0]}"]  # fmt: skip
    ((obs, _),) = audited_updates(load_config(CONFIGS / "base" / "paper001_victim.toml", victim))
    its = scale.iterations + WARMUP
    sme = SME(SMEConfig(max_iterations=its)).settings()
    variants: dict[str, Callable[[], tuple[list[float], list[float]]]] = {
        "floor": lambda: floor_times(obs, its),
        "sme": lambda: attack_times(obs, sme, "sme"),
    }
    for m in scale.nodes:
        s = PISME(PISMEConfig(max_iterations=its, nodes=m)).settings()
        variants[f"pisme_m{m}"] = lambda s=s: attack_times(obs, s, "pisme")
        s_nocal = PISME(PISMEConfig(max_iterations=its, nodes=m, calibrate=False)).settings()
        variants[f"pisme_m{m}_nocal"] = lambda s=s_nocal: attack_times(obs, s, "pisme")
    vmap_status: dict[str, str] = {}
    for m in scale.nodes:

        def vm(m: int = m) -> tuple[list[float], list[float]]:
            w, c, status = vmap_times(obs, m, its)
            vmap_status[str(m)] = status
            return w, c

        variants[f"vmap_m{m}_nocal"] = vm
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    loads = []
    for r in range(scale.repeats):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for key in order:
            w, c = variants[key]()
            wall[key] += w
            cpu[key] += c
        loads.append(os.getloadavg()[0])
        print(
            f"  round {r}: " + ", ".join(f"{k} {statistics.median(v):.4f}s" for k, v in wall.items() if v),
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in wall.items() if v}
    cmed = {k: statistics.median(v) for k, v in cpu.items() if v}
    ratios: dict[str, Any] = {
        "sme_over_floor": med["sme"] / med["floor"],
        "sme_over_floor_cpu": cmed["sme"] / cmed["floor"],
    }
    for m in scale.nodes:
        ratios[f"pisme_m{m}_over_m_sme"] = med[f"pisme_m{m}"] / (m * med["sme"])
        ratios[f"pisme_m{m}_over_m_sme_cpu"] = cmed[f"pisme_m{m}"] / (m * cmed["sme"])
        if f"vmap_m{m}_nocal" in med:
            ratios[f"vmap_m{m}_over_loop_m{m}_nocal"] = med[f"vmap_m{m}_nocal"] / med[f"pisme_m{m}_nocal"]
    meets = {
        "sme_within_1.1x_floor": ratios["sme_over_floor"] <= TARGET,
        **{f"pisme_m{m}_within_1.1x_m_sme": ratios[f"pisme_m{m}_over_m_sme"] <= TARGET for m in scale.nodes},
    }
    vmap_check = {str(m): check_vmap_matches(obs, m) for m in scale.nodes}
    payload = {
        "setting": {**asdict(scale), "model": "sme_cnn", "threads": threads, "warmup_dropped": WARMUP},
        "median_seconds": med,
        "median_cpu_seconds": cmed,
        "summaries": {k: summarize(v) for k, v in wall.items() if v},
        "ratios": ratios,
        "meets_target": meets,
        "vmap_status": vmap_status,
        "vmap_rel_diff_vs_loop": vmap_check,
        "loadavg_1min": loads,
        "contended": max(loads) > (os.cpu_count() or 1) + 0.5,
    }
    path = write_result(NAME, args.scale, payload, seeds=args.seeds[:1], out=args.out)
    print({k: round(v, 3) for k, v in ratios.items()}, meets, vmap_status, vmap_check)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

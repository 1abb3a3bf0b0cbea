"""Attack speed on ResNet-18 (issue 55, item 5): gradleak's Inverting Gradients and SME per iteration against
a bare reference loop of the same mathematics on the same input, one thread, and how the cost grows with the
batch size.

breaching (the field's reference implementation) needs torchvision, which cannot be installed beside this
machine's torch (README), so the reference is the obvious PyTorch loop written here without gradleak: the
forward pass, the parameter gradient with ``create_graph``, the cosine distance to the target, TV, the
backward pass to the images, the signed gradient, Adam, the step decay and the box (IG; Geiping et al.
2020, Eq. 4), or the same on the straight line ``alpha w0 + (1 - alpha) wT`` with ``alpha`` learnt (SME;
Zhu et al. 2023, Eq. 3). Both start from the same initial images; their reconstructions must agree (the
mean absolute pixel difference is recorded and checked), which shows they did the same work.

Timing: per batch size, ``reps`` rounds (gradleak first in even rounds, the reference first in odd ones)
of ``n`` and ``2n`` iterations of each after an untimed warm-up; the per-iteration time is ``(t(2n) - t(n))
/ n``, free of each side's fixed cost (recorded apart); ``ratio = median(gradleak) / median(reference)``;
target <= 1.0 (within the noise of the machine). The reconstructions of ``2n`` iterations must agree.

    python benchmarks/attack_speed.py --scale smoke|small|paper [--threads 1]
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from gradleak.attacks import create_attack
from gradleak.data import ImageDataset, load_dataset
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, summarize, write_result
from gradleak.models import build_model
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining, Observation

HERE = Path(__file__).resolve().parent
NAME = "attack_speed"
TARGET = 1.0
# the largest mean absolute pixel difference of the two reconstructions: IG's loops round alike (0 measured);
# SME's fused Adam rounds otherwise than the reference's plain one, which 10 steps of lr 1 amplify (3e-3)
AGREEMENT = {"ig": 1e-4, "sme": 1e-2}


@dataclass(frozen=True)
class Scale:
    width: int  # ResNet-18's base width (64: the real ResNet-18)
    batches: tuple[int, ...]
    iterations: int
    reps: int


SCALE = {
    "smoke": Scale(width=8, batches=(1, 2), iterations=2, reps=1),
    "small": Scale(width=64, batches=(1, 8), iterations=5, reps=3),
    "paper": Scale(width=64, batches=(1, 8, 32, 64), iterations=5, reps=3),
}


def cosine(grads: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
    dot = sum((g * t).sum() for g, t in zip(grads, target, strict=True))
    gn = sum(g.pow(2).sum() for g in grads)
    tn = sum(t.pow(2).sum() for t in target)
    return 1 - dot / (gn.sqrt() * tn.sqrt()).clamp_min(1e-12)  # type: ignore[union-attr]


def tv(x: torch.Tensor) -> torch.Tensor:
    return (x[:, :, :, 1:] - x[:, :, :, :-1]).abs().mean() + (x[:, :, 1:, :] - x[:, :, :-1, :]).abs().mean()


def reference_ig(
    model: nn.Module, target: list[torch.Tensor], y: torch.Tensor, x0: torch.Tensor, n: int
) -> torch.Tensor:
    """The bare IG loop (module docstring), gradleak's defaults: lr 0.1, TV 1e-2."""
    params = list(model.parameters())
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(n * f) for f in (3 / 8, 5 / 8, 7 / 8)], 0.1)
    for _ in range(n):
        opt.zero_grad()
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), params, create_graph=True)
        total = cosine(list(grads), target) + 1e-2 * tv(x)
        (g,) = torch.autograd.grad(total, [x])
        x.grad = g.sign()
        opt.step()
        sched.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    final = torch.autograd.grad(F.cross_entropy(model(x), y), params)  # the final matching loss, as ours
    cosine(list(final), target)
    return x.detach()


def reference_sme(
    model: nn.Module,
    w0: list[torch.Tensor],
    wt: list[torch.Tensor],
    y: torch.Tensor,
    z0: torch.Tensor,
    n: int,
) -> torch.Tensor:
    """The bare SME loop: images x = 0.5 + 0.25 z, Adam (lr 1 on z, 1e-3 on alpha), TV 5e-3, decay, box."""
    names = [k for k, _ in model.named_parameters()]
    fixed = {k: b for k, b in model.named_buffers()}
    target = [a - b for a, b in zip(w0, wt, strict=True)]
    z = z0.clone().requires_grad_(True)
    alpha = torch.tensor(0.5, requires_grad=True)
    opt = torch.optim.Adam([{"params": [z], "lr": 1.0}, {"params": [alpha], "lr": 1e-3}])
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [int(n * f) for f in (3 / 8, 5 / 8, 7 / 8)], 0.1)
    for _ in range(n):
        opt.zero_grad()
        point = [alpha * a + (1 - alpha) * b for a, b in zip(w0, wt, strict=True)]
        out = functional_call(model, {**fixed, **dict(zip(names, point, strict=True))}, (0.5 + 0.25 * z,))
        grads = torch.autograd.grad(F.cross_entropy(out, y), point, create_graph=True)
        (cosine(list(grads), target) + 5e-3 * tv(z)).backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            alpha.clamp_(0, 1)
            z.clamp_(-2.0, 2.0)
    point = [
        (alpha.detach() * a + (1 - alpha.detach()) * b).requires_grad_() for a, b in zip(w0, wt, strict=True)
    ]
    out = functional_call(
        model, {**fixed, **dict(zip(names, point, strict=True))}, (0.5 + 0.25 * z.detach(),)
    )
    cosine(
        list(torch.autograd.grad(F.cross_entropy(out, y), point)), target
    )  # the final matching loss, as ours
    return (0.5 + 0.25 * z.detach()).clamp(0, 1)


def time_pair(
    ours: Callable[[int], torch.Tensor], ref: Callable[[int], torch.Tensor], n: int, reps: int
) -> dict[str, object]:
    """Per-iteration seconds of both sides, free of their fixed costs (copying the model, the final
    matching loss): each rep times ``n`` and ``2n`` iterations of each, in alternating order, and takes
    ``(t(2n) - t(n)) / n``; the fixed cost is ``2 t(n) - t(2n)``."""
    ours(1), ref(1)  # warm-up
    per: dict[str, list[float]] = {"ours": [], "ref": []}
    fixed: dict[str, list[float]] = {"ours": [], "ref": []}
    diff = 0.0
    for r in range(reps):
        order = [("ours", ours), ("ref", ref)] if r % 2 == 0 else [("ref", ref), ("ours", ours)]
        t: dict[tuple[str, int], float] = {}
        got = {}
        for k in (n, 2 * n):
            for name, fn in order:
                start = time.perf_counter()
                got[name] = fn(k)
                t[name, k] = time.perf_counter() - start
        for name in per:
            per[name].append((t[name, 2 * n] - t[name, n]) / n)
            fixed[name].append(2 * t[name, n] - t[name, 2 * n])
        diff = max(diff, float((got["ours"] - got["ref"]).abs().mean()))
    return {"ours": summarize(per["ours"]), "reference": summarize(per["ref"]),
            "ours_fixed_seconds": summarize(fixed["ours"]),
            "reference_fixed_seconds": summarize(fixed["ref"]), "mean_abs_diff": diff}  # fmt: skip


def measure_batch(data: ImageDataset, b: int, scale: Scale, seed: int) -> list[dict[str, object]]:
    """Both attacks at batch size ``b``: gradleak's and the reference's times, and their agreement."""
    rows = []
    net = build_model("resnet18", (3, 32, 32), 10, seed=seed, width=scale.width).train()
    x, y = data.images[:b], data.labels[:b]
    batch = data.subset(torch.arange(b))
    sgd = train_client(
        0, net, batch, LocalTraining("fedsgd", batch_size=b), [], torch.Generator().manual_seed(0)
    )
    assert sgd.update is not None
    obs = Observation(net, sgd.update, (3, 32, 32), 10, labels=y)
    target = [sgd.update.tensors[k] for k, _ in net.named_parameters()]
    x0 = (0.5 + 0.25 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    n = scale.iterations
    ig_pair = time_pair(
        lambda k: (
            create_attack("ig", max_iterations=k)
            .reconstruct(obs, generator=torch.Generator().manual_seed(1))
            .images
        ),
        lambda k: reference_ig(net, target, y, x0, k),
        n,
        scale.reps,
    )
    step = LocalTraining("fedavg", epochs=2, batch_size=b, lr=0.01, shuffle=False)
    avg = train_client(0, net, batch, step, [], torch.Generator().manual_seed(0))
    assert avg.update is not None
    obs_avg = Observation(net, avg.update, (3, 32, 32), 10, labels=y, training=step)
    w0 = [p.detach().clone() for p in net.parameters()]
    wt = [p + avg.update.tensors[k] for (k, _), p in zip(net.named_parameters(), w0, strict=True)]
    z0 = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    sme_pair = time_pair(
        lambda k: (
            create_attack("sme", max_iterations=k)
            .reconstruct(obs_avg, generator=torch.Generator().manual_seed(1))
            .images
        ),
        lambda k: reference_sme(net, w0, wt, y, z0, k),
        n,
        scale.reps,
    )
    for attack, pair in (("ig", ig_pair), ("sme", sme_pair)):
        ours, ref = pair["ours"]["median"], pair["reference"]["median"]  # type: ignore[index]
        rows.append({"attack": attack, "batch": b, "seconds_per_iteration": ours,
                     "reference_seconds_per_iteration": ref, "ratio": ours / ref,
                     "agree": pair["mean_abs_diff"] <= AGREEMENT[attack], **pair})  # fmt: skip
        print(f"{attack} b={b}: {ours:.3f} s/it vs reference {ref:.3f} s/it, ratio {ours / ref:.3f}, "
              f"diff {pair['mean_abs_diff']:.2e}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__.split("\n")[0], HERE / "results")
    args = parse_args(parser, argv)
    threads = configure_torch(args.threads if args.threads is not None else 1)
    scale = SCALE[args.scale]
    data = load_dataset("cifar10", "test", limit=max(scale.batches))
    rows = [row for b in scale.batches for row in measure_batch(data, b, scale, args.seeds[0])]
    growth = {
        a: {r["batch"]: r["seconds_per_iteration"] for r in rows if r["attack"] == a} for a in ("ig", "sme")
    }
    payload = {
        "setting": {"model": "resnet18", "width": scale.width, "input": [3, 32, 32], "data": "cifar10/test",
                    "threads": threads, "iterations": scale.iterations, "reps": scale.reps,
                    "reference": "the bare PyTorch loop of this file (breaching needs torchvision)"},
        "target_ratio": TARGET,
        "rows": rows,
        "seconds_per_iteration_by_batch": growth,
        "max_ratio": max(r["ratio"] for r in rows),
        "all_agree": all(r["agree"] for r in rows),
        "loadavg": list(os.getloadavg()),
    }  # fmt: skip
    path = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {path}")
    return 0 if payload["all_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

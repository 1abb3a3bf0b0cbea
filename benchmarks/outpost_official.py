"""gradleak's Outpost beside the authors' own, on the same gradients (issue 54, item 4's side by side).

The authors' implementation is the Plato framework's gradient-leakage example
(``examples/gradient_leakage_attacks/defense/Outpost/perturb.py`` in TL-System/plato; fetch the repository
and pass its checkout with ``--plato``). It reads its options from ``plato.config.Config``; this script
stands a minimal ``Config`` with the example's defaults (phi 40, prune 80, noise 0.8) in its place, so only
that one file of Plato is imported. The file is read, never copied into gradleak. Three measurements on one
LeNet gradient of 8 seeded random images:

1. the official ``noise()`` as it stands: the largest change it makes to the gradients it returns;
2. the official computation with its perturbed tensor written back into the list it returns (its loop
   rebinds a local name and returns the input list), noise 0, against gradleak's at noise 0: the pruning
   alone (numpy's linear percentile against gradleak's lower one);
3. which coordinates get noise: the official rule (one Fisher value per input column, the mean of ``g^2``
   over each tensor's first axis) against gradleak's (each coordinate's own ``g^2``), as agreement.

    python benchmarks/outpost_official.py --plato /path/to/plato --scale small
"""

from __future__ import annotations

import copy
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.defenses.base import SetupContext
from gradleak.defenses.outpost import Outpost, OutpostConfig, kth_smallest
from gradleak.experiments.measurement import make_parser, parse_args, write_result
from gradleak.models import build_model

HERE = Path(__file__).resolve().parent
NAME = "outpost_official"
PERTURB = Path("examples/gradient_leakage_attacks/defense/Outpost/perturb.py")
_LOOP_END = "            .to(Config().device())\n        )\n"
WRITE_BACK = (_LOOP_END, _LOOP_END + "        dy_dx[i] = grad\n")  # the loop's result into the returned list


class _Config:
    """The example's Outpost options, where Plato's ``Config`` would read them from its YAML."""

    noise = 0.8

    def __init__(self) -> None:
        self.algorithm = types.SimpleNamespace(
            noise_random_seed=1, phi=40, prune_base=80, noise_base=self.noise
        )

    def device(self) -> str:
        return "cpu"


def official(source: str, name: str) -> Any:
    """The official module compiled from ``source`` with ``plato.config`` standing for Plato's."""
    plato, config = types.ModuleType("plato"), types.ModuleType("plato.config")
    config.Config = _Config  # type: ignore[attr-defined]
    sys.modules.setdefault("plato", plato)
    sys.modules["plato.config"] = config
    module = types.ModuleType(name)
    exec(compile(source, name, "exec"), module.__dict__)  # noqa: S102 (the authors' file, read-only)
    return module


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    parser.add_argument("--plato", type=Path, required=True, help="a checkout of TL-System/plato")
    args = parse_args(parser, argv)
    path = args.plato / PERTURB
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass a checkout of TL-System/plato as --plato")
    source = path.read_text(encoding="utf-8")
    if WRITE_BACK[0] not in source:
        raise SystemExit(f"{path} is not the version this script reads (its perturbation loop changed)")
    seed = args.seeds[0]
    model = build_model("lenet", (3, 32, 32), 10, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    total = sum(t.numel() for t in grads)

    as_is = official(source, "perturb_as_is")
    risk = as_is.compute_risk(model)
    returned = as_is.noise(dy_dx=[t.clone() for t in grads], risk=risk)
    change = max(float((a - b).abs().max()) for a, b in zip(returned, grads, strict=True))

    _Config.noise = 0.0
    written = official(source.replace(*WRITE_BACK), "perturb_written_back")
    theirs = written.noise(dy_dx=[t.clone() for t in grads], risk=risk)
    mine = copy.deepcopy(model)
    for p, t in zip(mine.parameters(), grads, strict=True):
        p.grad = t.clone()
    defense = Outpost(OutpostConfig(beta=0.0, noise=0.0))
    defense.setup(mine, SetupContext(torch.Generator().manual_seed(seed)))
    defense.on_gradients(mine, 0)
    ours = [p.grad for p in mine.parameters() if p.grad is not None]
    pruned_differ = sum(int(((a != 0) != (b != 0)).sum()) for a, b in zip(theirs, ours, strict=True))

    fim = [t.pow(2).mean(0) for t in grads]
    threshold = np.percentile(np.concatenate([f.flatten().numpy() for f in fim]), 60)
    their_mask = [np.broadcast_to(f.numpy() >= threshold, t.shape) for f, t in zip(fim, grads, strict=True)]
    our_threshold = kth_smallest(torch.cat([t.reshape(-1).pow(2) for t in grads]), 0.6)
    our_mask = [(t.pow(2) >= our_threshold).numpy() for t in grads]
    agree = sum(int((a == b).sum()) for a, b in zip(their_mask, our_mask, strict=True))
    payload = {
        "plato_file": str(PERTURB),
        "coordinates": total,
        "official_as_is_max_abs_change": change,
        "pruning_zero_pattern_differs": pruned_differ,
        "noise_mask_agreement": agree / total,
        "noise_mask_share_official": float(sum(m.sum() for m in their_mask) / total),
        "noise_mask_share_ours": float(sum(m.sum() for m in our_mask) / total),
    }
    out = write_result(NAME, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {out}: {payload}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

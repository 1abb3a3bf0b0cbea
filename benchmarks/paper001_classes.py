"""Paper 001, Sec. 4.3 / Fig. 2 analogue: class deficiency, client batches drawn from C in {10, 5, 3, 2}.

For softmax cross-entropy the last-layer update has rank <= min(k, C - 1) (Eq. 11): fewer classes leave a
lower-rank signal. SME, NL-SME and PI-SME invert a T = 100 update of a CIFAR-10 client whose k images come
from C random classes (at least one image per class). Paper 001 (CIFAR-100, C from 100 down to 10): all
three degrade as C falls, PI-SME slowest; its margin over NL-SME grows from ~0.8 dB (C = 100) to ~4.2 dB
(C = 10). CIFAR-10 has only 10 classes, so our sweep covers the paper's low end and below. The ``small``
scale uses FEMNIST (k = 4 images pooled over the test writers, C in {4, 3, 2}), because at 100 iterations no
attack recovers CIFAR-10 images (Table 1, small).

    python benchmarks/paper001_classes.py --scale smoke|small|paper --seeds 0 1 2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from _common import configure_torch, make_parser, parse_args
from paper001_common import Victim
from paper001_sweeps import Cell, run_cells

NAME = "paper001_classes"
ATTACKS = ("sme", "nlsme", "pisme")


@dataclass(frozen=True)
class Scale:
    dataset: str
    k: int
    batch_size: int
    epochs: int
    iterations: int
    classes: tuple[int, ...] = (10, 5, 3, 2)


SCALES = {
    "smoke": Scale("cifar10", 4, 2, 5, 2, (4, 2)),
    # small: FEMNIST (CIFAR-10 images are not recovered by any attack at 100 iterations, Table 1 small)
    "small": Scale("femnist", 4, 2, 50, 100, (4, 3, 2)),
    "paper": Scale("cifar10", 50, 10, 20, 1000),
}


def margins(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key in {k.rsplit("/", 1)[0] for k in summary}:
        p, n = summary.get(f"{key}/pisme"), summary.get(f"{key}/nlsme")
        if p and n:
            out[f"{key}/pisme_minus_nlsme_db"] = p["psnr_mean"] - n["psnr_mean"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(make_parser(__doc__.splitlines()[0]), argv)
    s = SCALES[args.scale]
    configure_torch(args.threads if args.threads is not None else 1)
    victim = Victim(s.k, s.batch_size, s.epochs)
    cells = [
        Cell(f"C={c}/{a}", s.dataset, victim, a, {"max_iterations": s.iterations}, classes=c)
        for c in s.classes if c <= s.k for a in ATTACKS
    ]  # fmt: skip
    run_cells(NAME, args, cells, {**s.__dict__, "steps": victim.steps}, extra=margins)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Paper 001, Table 2 analogue: PI-SME node-count sweep, m in {3, 4, 5, 7, 10, 12}.

Same victims as Table 1 (``paper001_common``); only PI-SME runs, every other option at paper 001's
defaults. Paper 001 (PSNR dB, mean of five seeds):

    m    CIFAR-100 T=100  T=250   FEMNIST T=100  T=250
    3        26.49        22.97       25.08      24.00
    4        26.63        23.14       25.21      24.24
    5        26.73        23.05       24.86      24.34
    7        26.52        23.20       25.34      24.37
    10       26.55        23.10       25.43      24.34
    12       26.72        23.36       25.09      24.17

    python benchmarks/paper001_table2.py --scale smoke|small|paper --seeds 0 1 2 \
        [--datasets femnist] [--steps 100]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from _common import configure_torch, make_parser, parse_args
from paper001_common import Victim
from paper001_sweeps import Cell, add_steps_option, run_cells, select_epochs

NAME = "paper001_table2"
PAPER = {
    "cifar10": {
        100: [26.49, 26.63, 26.73, 26.52, 26.55, 26.72],
        250: [22.97, 23.14, 23.05, 23.20, 23.10, 23.36],
    },
    "femnist": {
        100: [25.08, 25.21, 24.86, 25.34, 25.43, 25.09],
        250: [24.00, 24.24, 24.34, 24.37, 24.34, 24.17],
    },
}
PAPER_NODES = (3, 4, 5, 7, 10, 12)


@dataclass(frozen=True)
class Scale:
    datasets: tuple[str, ...]
    k: int
    batch_size: int
    epochs: tuple[int, ...]
    iterations: int
    nodes: tuple[int, ...] = PAPER_NODES


SCALES = {
    "smoke": Scale(("cifar10",), 2, 1, (5,), 2, (3, 7)),
    "small": Scale(("cifar10", "femnist"), 4, 2, (50, 125), 100),
    "paper": Scale(("cifar10", "femnist"), 50, 10, (20, 50), 1000),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", choices=("cifar10", "femnist"), help="subset of the scale's")
    add_steps_option(parser)
    args = parse_args(parser, argv)
    s = SCALES[args.scale]
    datasets = tuple(args.datasets) if args.datasets else s.datasets
    epochs, suffix = select_epochs(parser, args, s.k, s.batch_size, s.epochs)
    configure_torch(args.threads if args.threads is not None else 1)
    cells = [
        Cell(f"{ds}/T={Victim(s.k, s.batch_size, e).steps}/m={m}", ds, Victim(s.k, s.batch_size, e), "pisme",
             {"max_iterations": s.iterations, "nodes": m})
        for ds in datasets for e in epochs for m in s.nodes
    ]  # fmt: skip
    paper = {
        f"{ds}/T={t}/m={m}": v
        for ds, by_t in PAPER.items()
        for t, vs in by_t.items()
        for m, v in zip(PAPER_NODES, vs, strict=True)
    }
    name = NAME if datasets == s.datasets else f"{NAME}_{'_'.join(datasets)}"
    run_cells(
        name + suffix,
        args,
        cells,
        {
            **s.__dict__,
            "datasets": datasets,
            "epochs": epochs,
            "paper_psnr": paper,
            "note": "CIFAR-10 stands in for CIFAR-100",
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

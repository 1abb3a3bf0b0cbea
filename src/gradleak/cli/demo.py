"""``gradleak demo``: the embedded default privacy audit (OrganAMNIST, 100 non-IID clients, IG)."""

from __future__ import annotations

import argparse
from importlib import resources
from typing import Any

from gradleak.cli.run import add_output_args, execute
from gradleak.experiments import load_config


def demo_config_path() -> str:
    return str(resources.files("gradleak.experiments").joinpath("demo.toml"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the embedded default audit (a few minutes on 2 CPU cores)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. fl.rounds=1")
    add_output_args(p)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    print(f"gradleak demo: config {demo_config_path()}")
    execute(load_config(demo_config_path(), args.overrides), args)
    return 0

"""``gradleak list``: the registered datasets, models, attacks, defenses and engines."""

from __future__ import annotations

import argparse
from typing import Any

import gradleak.attacks  # noqa: F401  (registration)
import gradleak.data  # noqa: F401
import gradleak.defenses  # noqa: F401
import gradleak.models  # noqa: F401
from gradleak.cli.run import add_plugin_arg
from gradleak.plugins import load_plugins
from gradleak.registry import ATTACKS, DATASETS, DEFENSES, ENGINES, GENERATORS, MODELS, PARTITIONERS, PRESETS


def add_parser(sub: Any) -> None:
    p = sub.add_parser("list", help="show registered datasets, models, attacks, defenses, engines")
    add_plugin_arg(p)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    load_plugins(args.plugin)
    for title, reg in (
        ("datasets", DATASETS),
        ("models", MODELS),
        ("attacks", ATTACKS),
        ("defenses", DEFENSES),
        ("engines", ENGINES),
        ("generators (Aegis' synthetic cache: generator = NAME)", GENERATORS),
    ):  # fmt: skip
        print(f"{title}:")
        for e in reg:
            tag = f"[{e.modality}] " if e.modality else ""
            print(f"  {e.name:<16} {tag}{e.summary}")
    print("defense presets (a defense at named settings; options beside the name override them):")
    for entry in PRESETS:
        preset = entry.factory()
        options = ", ".join(f"{k}={v}" for k, v in preset.options.items())
        print(f"  {entry.name:<16} {preset.defense}({options}): {preset.summary}")
    print("partitioners:")
    for name in PARTITIONERS.names():
        print(f"  {name}")
    return 0

"""``gradleak check CONFIG [key=value ...]``: everything a run checks before its first round, without the run.

The config (names, options, rules), the plugins, the data files, the partition, the model, the run's cost
on this machine (:mod:`gradleak.experiments.resources`) and the audit's pre-flight checks
(:mod:`gradleak.audit.preflight`: the attacks' budgets, their fit for the update they will read, the
model's input range). It prints what it built and every warning, and exits 2 with the reasons where a run
would be refused; nothing is trained or written.
"""

from __future__ import annotations

import argparse
from typing import Any

from gradleak.cli.run import add_plugin_arg
from gradleak.experiments import load_config
from gradleak.experiments.runner import build_simulation, preflight
from gradleak.plugins import load_plugins


def add_parser(sub: Any) -> None:
    p = sub.add_parser("check", help="check a config and what it builds before running it (no training)")
    p.add_argument("config", help="path to the experiment TOML file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. fl.rounds=2")
    add_plugin_arg(p)
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    load_plugins(args.plugin)
    cfg = load_config(args.config, args.overrides, trust_plugins=args.trust_config_plugins)
    sim = build_simulation(cfg)  # data, partition, model, defenses: refused here where a run would be
    # a sample of the clients' data for the input-range check (preflight reads its first 256 samples)
    sample, total = [], 0
    for client in sim.clients:
        sample.append(client)
        total += len(client)
        if total >= 256:
            break
    warnings = preflight(cfg, sim.model, type(sample[0]).concat(sample))  # type: ignore[arg-type]
    params = sum(p.numel() for p in sim.model.parameters())
    sizes = [len(c) for c in sim.clients]
    print(f"config {args.config}: ok")
    print(f"  data: {cfg.data.dataset}, {sum(sizes)} training samples over {len(sizes)} clients "
          f"({min(sizes)}-{max(sizes)} each), partition {cfg.data.partition}")  # fmt: skip
    print(f"  model: {cfg.model.name}, {params:,} parameters; FL: {cfg.fl.rounds} rounds, "
          f"{cfg.fl.fraction:.0%} of the clients a round, {cfg.fl.training.protocol}")  # fmt: skip
    attacks = ", ".join(s.name for s in cfg.audit.attacks) if cfg.audit.clients else "none (no audit)"
    print(f"  audit: {cfg.audit.clients} client(s), {cfg.audit.training.protocol}, attacks {attacks}")
    print(f"  defenses: {', '.join(s.name for s in cfg.defenses) or 'none'}")
    for w in warnings:
        print(f"  warning: {w}")
    return 0

"""``gradleak check CONFIG [key=value ...]``: everything a run checks before its first round, without the run.

The config (names, options, rules), the plugins, the data files, the partition, the model, the run's cost
on this machine (:mod:`gradleak.experiments.resources`) and the audit's pre-flight checks
(:mod:`gradleak.audit.preflight`: the attacks' budgets, their fit for the update they will read, the
model's input range). It prints what it built and every warning, and exits 2 with the reasons where a run
would be refused; nothing is trained or written. ``--dry-run-defenses`` also runs the defenses' setup on
client 0, as its first local training would (Aegis: the generator's training and the cache build, which
stops after its pilot draw when the cache cannot be filled), and exits 2 with the defense's reason.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch

from gradleak.cli.run import add_plugin_arg
from gradleak.defenses.base import DefenseFailure
from gradleak.defenses.in_loop import DefendedLoop
from gradleak.experiments import load_config
from gradleak.experiments.runner import build_simulation, preflight
from gradleak.federation.simulation import FederatedSimulation
from gradleak.plugins import load_plugins
from gradleak.tasks.client import make_optimizer


def add_parser(sub: Any) -> None:
    p = sub.add_parser("check", help="check a config and what it builds before running it (no training)")
    p.add_argument("config", help="path to the experiment TOML file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. fl.rounds=2")
    p.add_argument(
        "--dry-run-defenses",
        action="store_true",
        help="also set the defenses up on client 0 as its first training would (Aegis: generator and cache)",
    )
    add_plugin_arg(p)
    p.set_defaults(handler=handle)


def dry_run_defenses(sim: FederatedSimulation, seed: int) -> str | None:
    """Set the simulation's defenses up on client 0 as :func:`~gradleak.tasks.client.train_client` does
    before its first step; the failure's reason, or None."""
    model = copy.deepcopy(sim.model).train()
    try:
        DefendedLoop(
            model, lambda params: make_optimizer(list(params), sim.config.training), list(sim.defenses()),
            generator=torch.Generator().manual_seed(seed), data=sim.clients[0], train_data=sim.clients[0],
            source="client 0 (dry run)",
        )  # fmt: skip
    except DefenseFailure as exc:
        return str(exc)
    return None


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
    if args.dry_run_defenses and cfg.defenses:
        start = time.perf_counter()
        failure = dry_run_defenses(sim, cfg.experiment.seed)
        seconds = time.perf_counter() - start
        if failure is not None:
            print(f"  defenses: client 0's setup failed after {seconds:.1f} s: {failure}")
            return 2
        print(f"  defenses: client 0's setup ok in {seconds:.1f} s")
    return 0

"""gradleak: measure and stop gradient leakage in federated learning.

The public API, imported on first use (``import gradleak`` stays cheap: torch, transformers and Flower load
only when a name that needs them is read)::

    import gradleak

    config = gradleak.load_config("audit.toml")          # a config file, validated before any work
    summary = gradleak.run_experiment(config)            # train, observe, attack, score, record
    attack = gradleak.create_attack("ig", max_iterations=100)
    loop = gradleak.defend(model, optimizer, ["dp_sgd"])  # defend your own PyTorch loop

Everything else is importable from its package (docs/architecture.md lists every package and its job).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradleak.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it (one place; read by __getattr__ and __dir__)
_EXPORTS: dict[str, str] = {
    # run an audit from a config
    "load_config": "gradleak.experiments.config",
    "ExperimentConfig": "gradleak.experiments.config",
    "run_experiment": "gradleak.experiments.runner",
    "ResultStore": "gradleak.experiments.store",
    # what a client sends, what an attacker sees and returns
    "Update": "gradleak.update",
    "LocalTraining": "gradleak.update",
    "Observation": "gradleak.types",
    "Reconstruction": "gradleak.types",
    "Attack": "gradleak.types",
    # attacks and defenses by name
    "create_attack": "gradleak.attacks",
    "defend": "gradleak.defenses.in_loop",
    "DefendedLoop": "gradleak.defenses.in_loop",
    "Defense": "gradleak.defenses.base",
    "DefenseFailure": "gradleak.defenses.base",
    "ComponentSpec": "gradleak.spec",
    # on Flower (the flower extra): audit a server's strategy, defend a ClientApp's replies
    "AuditStrategy": "gradleak.integrations.flower.audit",
    "DefenseMod": "gradleak.integrations.flower.mods",
    # the registries a plugin extends
    "ATTACKS": "gradleak.registry",
    "DEFENSES": "gradleak.registry",
    "DATASETS": "gradleak.registry",
    "MODELS": "gradleak.registry",
    "ENGINES": "gradleak.registry",
    "GENERATORS": "gradleak.registry",
    "TASKS": "gradleak.registry",
    "PARTITIONERS": "gradleak.registry",
    "OPTIMIZERS": "gradleak.registry",
}

__all__ = [  # the names of _EXPORTS (a test keeps the two equal)
    "__version__", "load_config", "ExperimentConfig", "run_experiment", "ResultStore", "Update",
    "LocalTraining", "Observation", "Reconstruction", "Attack", "create_attack", "defend", "DefendedLoop",
    "Defense", "DefenseFailure", "ComponentSpec", "AuditStrategy", "DefenseMod", "ATTACKS", "DEFENSES",
    "DATASETS", "MODELS", "ENGINES", "GENERATORS", "TASKS", "PARTITIONERS", "OPTIMIZERS",
]  # fmt: skip

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from gradleak.attacks import create_attack
    from gradleak.defenses.base import Defense, DefenseFailure
    from gradleak.defenses.in_loop import DefendedLoop, defend
    from gradleak.experiments.config import ExperimentConfig, load_config
    from gradleak.experiments.runner import run_experiment
    from gradleak.experiments.store import ResultStore
    from gradleak.integrations.flower.audit import AuditStrategy
    from gradleak.integrations.flower.mods import DefenseMod
    from gradleak.registry import (
        ATTACKS,
        DATASETS,
        DEFENSES,
        ENGINES,
        GENERATORS,
        MODELS,
        OPTIMIZERS,
        PARTITIONERS,
        TASKS,
    )
    from gradleak.spec import ComponentSpec
    from gradleak.types import Attack, Observation, Reconstruction
    from gradleak.update import LocalTraining, Update


__getattr__ = lazy_exports(__name__, _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

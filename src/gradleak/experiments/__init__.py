"""Experiments: TOML configs, the runner, the SQLite store, figures."""

from gradleak.experiments.config import ConfigError, ExperimentConfig, load_config
from gradleak.experiments.runner import RunOutcome, run_experiment
from gradleak.experiments.store import ResultStore

__all__ = ["ConfigError", "ExperimentConfig", "ResultStore", "RunOutcome", "load_config", "run_experiment"]

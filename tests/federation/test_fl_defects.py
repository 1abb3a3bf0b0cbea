"""Defects read in the code (issue 51, item 6), each fixed with the test that shows it: evaluating the
global model no longer leaves it in train mode (an eval-mode model switched to batch statistics), and a run
records the commit of gradleak's own checkout, not of whatever repository the command runs in."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from gradleak.experiments.runner import environment
from gradleak.metrics.utility import top1_accuracy
from gradleak.models import build_model

ROOT = Path(__file__).resolve().parents[2]


def test_evaluate_restores_the_models_mode():
    model = build_model("sme_cnn", (1, 12, 12), 3, seed=0)
    images, labels = torch.rand(4, 1, 12, 12), torch.tensor([0, 1, 2, 0])
    for training in (False, True):
        model.train(training)
        top1_accuracy(model, images, labels)
        assert model.training is training


def test_a_run_records_the_packages_commit_wherever_it_is_started(tmp_path, monkeypatch):
    other = tmp_path / "someone-elses-repo"
    other.mkdir()
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)  # fmt: skip
    monkeypatch.chdir(other)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert environment()["git_commit"] == head.stdout.strip()

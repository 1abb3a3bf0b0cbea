"""The registries are typed by what they build (issue 51 item 4), and the front door exports lazily (item 5).

``make lint`` runs mypy on this file: ``assert_type`` fails type checking if ``ATTACKS.create`` stopped
returning an Attack or ``DEFENSES.create`` a Defense; at run time the tests check the same of the objects.
"""

from __future__ import annotations

import subprocess
import sys
from typing import assert_type

import pytest
import torch

import gradleak
from gradleak.defenses.base import Defense
from gradleak.registry import ATTACKS, DEFENSES, OPTIMIZERS, PARTITIONERS, TASKS, Registry, UnknownNameError
from gradleak.tasks.base import Task
from gradleak.types import Attack


def test_create_returns_what_the_registry_builds():
    attack = assert_type(ATTACKS.create("ig", max_iterations=3), Attack)
    defense = assert_type(DEFENSES.create("pruning", ratio=0.5), Defense)
    task = assert_type(TASKS.create("causal_lm"), Task)
    assert isinstance(attack, Attack) and type(attack).__name__ == "InvertingGradients"
    assert isinstance(defense, Defense) and defense.name == "pruning"
    assert task.name == "causal_lm" and task.mode == "eval"


def test_the_former_name_maps_are_registries_a_plugin_can_extend(monkeypatch):
    """Tasks, partitioners and optimisers were plain dicts; a plugin now registers into them like any
    other entry, and an unknown name lists the known ones."""
    assert set(OPTIMIZERS.names()) >= {"sgd", "adam", "adamw"}
    assert set(PARTITIONERS.names()) >= {"iid", "label_skew", "dirichlet", "natural"}
    assert set(TASKS.names()) >= {"image_classification", "text_classification", "causal_lm"}
    registry: Registry[torch.optim.Optimizer] = OPTIMIZERS
    monkeypatch.setattr(registry, "_entries", dict(registry._entries))  # undone after the test
    registry.register("rmsprop", torch.optim.RMSprop, summary="a plugin's optimiser")
    from gradleak.update import LocalTraining

    assert LocalTraining(protocol="fedavg", optimizer="rmsprop").optimizer == "rmsprop"
    with pytest.raises(UnknownNameError, match="known optimizers: adam, adamw, rmsprop, sgd"):
        OPTIMIZERS.get("lion")


def test_the_front_door_exports_its_names_lazily():
    """``import gradleak`` loads neither torch nor the packages behind the exports; every exported name
    resolves to the object its module defines."""
    code = (
        "import sys, gradleak; print(sorted(m for m in sys.modules if m.startswith(('torch', 'gradleak.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['gradleak.lazy']"  # the 20-line helper behind the lazy exports, nothing else
    assert set(gradleak.__all__) == {"__version__", *gradleak._EXPORTS}
    for name, module in gradleak._EXPORTS.items():
        assert getattr(gradleak, name) is getattr(sys.modules[module], name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = gradleak.nope

"""Plugins: a user's module registers a data set and a model that ``gradleak run`` then uses (by
``--plugin``, by the config's ``experiment.plugins``, by an installed entry point), and a bad plugin is one
clear error before any work. The generic ``medmnist`` loader reads any official archive by its flag."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradleak import plugins
from gradleak.cli import main
from gradleak.data import DataFileMissingError, load_dataset
from gradleak.experiments import ResultStore, load_config
from gradleak.experiments.config import ConfigError
from gradleak.registry import DATASETS, MODELS

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugins" / "organ_kidney.py"
CONFIG = ROOT / "examples" / "plugins" / "kidney_audit.toml"
FAST = ["fl.rounds=1", "data.train_limit=600", "data.test_limit=200", "audit.attacks.0.max_iterations=3"]


def test_a_plugin_given_by_flag_registers_a_dataset_and_model_that_gradleak_run_uses(tmp_path, capsys):
    out = tmp_path / "out"
    # the config without its own plugins line: the flag alone must make "kidneys" and "tiny_mlp" known
    args = ["run", "--plugin", str(PLUGIN), str(CONFIG), *FAST, "experiment.plugins=[]", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    (run,) = ResultStore(out / "results.sqlite").runs()
    assert run.config["data"]["dataset"] == "kidneys" and run.config["model"]["name"] == "tiny_mlp"
    store = ResultStore(out / "results.sqlite")
    (attack,) = store.records(run.run_id, "attack")
    assert attack["batch_size"] == 4 and 0.0 <= attack["label_accuracy"] <= 1.0
    # the plugin's loader: label 1 exactly for OrganAMNIST's kidney slices (organs 4 and 5)
    organs, kidneys = (
        load_dataset("organamnist", "test", limit=300),
        load_dataset("kidneys", "test", limit=300),
    )
    assert torch.equal(kidneys.labels, ((organs.labels == 4) | (organs.labels == 5)).long())
    assert kidneys.num_classes == 2 and torch.equal(kidneys.images, organs.images)
    model = MODELS.get("tiny_mlp")((1, 28, 28), 2, hidden=8)
    assert sum(p.numel() for p in model.parameters()) == 784 * 8 + 8 + 8 * 2 + 2
    assert main(["list", "--plugin", str(PLUGIN)]) == 0
    assert re.search(r"kidneys\s+\[image\] plugin: OrganAMNIST", capsys.readouterr().out)


def test_the_config_names_its_plugins_relative_to_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config(CONFIG, FAST, trust_plugins=True)
    assert cfg.experiment.plugins == ["organ_kidney.py"] and cfg.data.dataset == "kidneys"


def write(tmp_path: Path, name: str, code: str) -> Path:
    path = tmp_path / name
    path.write_text(code)
    return path


BAD = {
    "missing": (None, r"plugin file .*nowhere\.py does not exist"),
    "raises": (
        "raise RuntimeError('no licence key')\n",
        r"raised while it was imported: RuntimeError: no licence key",
    ),
    "clash": (
        "from gradleak.registry import DATASETS\nDATASETS.register('organamnist', lambda split='train', "
        "root=None, limit=None: None)\n",
        r"dataset 'organamnist' is already registered",
    ),
    "signature": (
        "from gradleak.registry import DATASETS\nDATASETS.register('odd', lambda path: None)\n",
        r"dataset 'odd': the factory must accept \(split=\.\.\., root=\.\.\., limit=\.\.\.\)",
    ),
    "module": (None, r"plugin module 'no_such_gradleak_plugin' not found"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_plugin_is_one_clear_error_before_any_work(tmp_path, capsys, case):
    code, message = BAD[case]
    if case == "module":
        spec = "no_such_gradleak_plugin"
    elif code is None:
        spec = str(tmp_path / "nowhere.py")
    else:
        spec = str(write(tmp_path, f"bad_{case}.py", code))
    out = tmp_path / "out"
    assert main(["run", "--plugin", spec, str(CONFIG), *FAST, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert "Traceback" not in err and not out.exists()


def test_the_config_reports_a_bad_plugin_entry(tmp_path):
    with pytest.raises(ConfigError, match="experiment.plugins must be a list of module names or paths"):
        load_config(CONFIG, ["experiment.plugins='organ_kidney.py'"])
    with pytest.raises(ConfigError, match=r"experiment.plugins: plugin file .*absent\.py does not exist"):
        load_config(CONFIG, ["experiment.plugins=['absent.py']"], trust_plugins=True)


def test_installed_entry_points_are_loaded_when_a_registry_is_first_used(tmp_path, monkeypatch):
    write(tmp_path, "gl_entry_point_plugin.py",
          "from gradleak.registry import MODELS\nimport torch\n"
          "MODELS.register('ep_linear', lambda shape, classes: torch.nn.Linear(1, classes))\n")  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib.metadata.EntryPoint("demo", "gl_entry_point_plugin", plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        plugins.importlib.metadata, "entry_points", lambda group: [ep] if group == ep.group else []
    )
    assert "ep_linear" not in MODELS
    assert plugins.load_entry_points() == ["demo"]
    assert "ep_linear" in MODELS and plugins.load_entry_points() == []  # once
    sys.modules.pop("gl_entry_point_plugin", None)


def official_archive(
    root: Path, flag: str, *, classes: int, channels: int, labels_per_image: int = 1
) -> None:
    """An archive laid out like MedMNIST v2's: {split}_images uint8, {split}_labels (N, k)."""
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 40), ("val", 10), ("test", 20)):
        shape = (n, 28, 28) if channels == 1 else (n, 28, 28, channels)
        arrays[f"{split}_images"] = rng.integers(0, 256, shape, dtype=np.uint8)
        arrays[f"{split}_labels"] = rng.integers(0, classes, (n, labels_per_image)).astype(np.uint8)
    arrays["train_labels"][0, 0] = classes - 1  # the largest class is present
    (root / "medmnist").mkdir(parents=True, exist_ok=True)
    np.savez(root / "medmnist" / f"{flag}.npz", **arrays)


def test_the_generic_medmnist_loader_reads_any_official_archive_by_flag(tmp_path):
    official_archive(tmp_path, "bloodmnist", classes=8, channels=3)
    data = load_dataset("medmnist", "val", tmp_path, options={"flag": "bloodmnist"})
    with np.load(tmp_path / "medmnist" / "bloodmnist.npz") as npz:
        images, labels = npz["val_images"], npz["val_labels"]
    assert data.name == "bloodmnist" and data.num_classes == 8 and data.images.shape == (10, 3, 28, 28)
    expected = torch.from_numpy(images.transpose(0, 3, 1, 2).astype(np.float32) / 255.0)
    torch.testing.assert_close(data.images, expected, atol=0, rtol=0)
    assert torch.equal(data.labels, torch.from_numpy(labels.reshape(-1).astype(np.int64)))
    explicit = load_dataset("medmnist", "test", tmp_path, options={"flag": "bloodmnist", "num_classes": 10})
    assert explicit.num_classes == 10
    overrides = ["experiment.plugins=[]", "data.dataset='medmnist'", "data.options={flag = 'bloodmnist'}",
                 f"experiment.data_root='{tmp_path}'"]  # fmt: skip
    plugins.load_plugin(str(PLUGIN))  # the config's model (tiny_mlp), whichever test ran first on this worker
    cfg = load_config(CONFIG, overrides)
    assert cfg.data.options == {"flag": "bloodmnist"}


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({}, ValueError, r"flag must name an official MedMNIST 2D archive such as 'bloodmnist'"),
        ({"flag": "../etc/passwd"}, ValueError, r"flag must name an official MedMNIST 2D archive"),
        ({"flag": "dermamnist"}, DataFileMissingError, r"medmnist/dermamnist\.npz"),
        (
            {"flag": "chestmnist"},
            ValueError,
            r"chestmnist: multi-label archives \(ChestMNIST\) are not supported",
        ),
        ({"flag": "bloodmnist", "colour": True}, ValueError, r"unknown option\(s\) \['colour'\]"),
    ],
)
def test_the_generic_medmnist_loader_refuses_what_it_cannot_read(tmp_path, options, error, message):
    official_archive(tmp_path, "bloodmnist", classes=8, channels=3)
    official_archive(tmp_path, "chestmnist", classes=2, channels=1, labels_per_image=14)
    with pytest.raises(error, match=message):
        load_dataset("medmnist", "train", tmp_path, options=options)


def test_a_dataset_without_options_refuses_them():
    with pytest.raises(ConfigError, match=r"data.options: dataset 'organamnist' takes no options"):
        load_config(CONFIG, ["experiment.plugins=[]", "data.dataset='organamnist'", "model.name='aegis_cnn'",
                             "model.options={}", "data.options={flag = 'x'}"])  # fmt: skip
    assert "medmnist" in DATASETS

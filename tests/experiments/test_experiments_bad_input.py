"""Each bad input of the reliability review fails before any work with an error that names the problem, and
writes nothing: no output folder, no store file."""

from __future__ import annotations

import os
import re

import pytest

from gradleak.cli import main
from gradleak.data import resolve_data_root

RTF = "examples/organamnist_robbing_the_fed.toml"
SMALL = [
    "data.train_limit=2000",
    "data.test_limit=200",
    "audit.public_limit=64",
    "audit.attacks.0.num_bins=32",
]


@pytest.fixture
def organamnist_only(tmp_path):
    """A data root holding OrganAMNIST and nothing else."""
    root = tmp_path / "data"
    (root / "medmnist").mkdir(parents=True)
    os.symlink(resolve_data_root() / "medmnist" / "organamnist.npz", root / "medmnist" / "organamnist.npz")
    return root


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fl.training.lr=inf"], r"config.fl.training.lr: must be a finite number, got inf"),
        (["fl.training.lr=nan"], r"config.fl.training.lr: must be a finite number, got nan"),
        (["fl.server_lr=inf"], r"config.fl.server_lr: must be a finite number"),
        (["audit.clients=500"], r"audit.clients = 500 exceeds the 10 clients sampled per round"),
        (["audit.attacks=['dager']"], r"audit.attacks\[0\] works on text tasks, but data.dataset = "
                                      r"'organamnist' holds image data"),
        (["defenses=['aegis_llm']"], r"defenses\[0\] works on text tasks"),
        (["audit.grant_lengths=true"], r"audit.grant_lengths works on text tasks, but data.dataset = "),
        (["audit.attacks.0.num_bins='many'"],
         r"audit.attacks\[0\]: attack 'robbing_the_fed' option num_bins: expected int, got str 'many'"),
        (["audit.public_dataset='cifar10'"], r"audit.public_dataset = 'cifar10' gives images of shape "
                                             r"\(3, 32, 32\), but the task's images are \(1, 28, 28\)"),
        (["engine.name='spark'"], r"engine.name: unknown engine 'spark'; known engines: flower, inprocess"),
        (["engine.name='flower'", "engine.options.timeout=0"],
         r"engine: engine 'flower': timeout must be a positive finite number, got 0.0"),
        (["engine.name='flower'", "engine.options.client_cpus=4"], r"client_cpus = 4.0 exceeds cpus = 2"),
        (["engine.options.timeout=5"], r"engine: engine 'inprocess' takes no options, got \['timeout'\]"),
        (["engine.name='flower'", "engine.options.secagg.enabled=true"],
         r"secagg.enabled runs Flower's SecAgg\+ protocol, which needs fl.secure_aggregation = true"),
        (["engine.name='flower'", "engine.options.secagg.enabled=true", "fl.secure_aggregation=true",
          "audit.clients=1"],
         r"SecAgg\+ needs at least 2 clients in a round; the audit \(audit.clients\) has 1"),
        (["engine.name='flower'", "engine.options.secagg.enabled=true", "fl.secure_aggregation=true",
          "audit.clients=2", "engine.options.secagg.quantization_range=1000000000"],
         r"overflows the 2\*\*32 modulus \(a training round"),
        (["audit.pick='last'"], r"audit.pick must be one of \['first', 'random'\], got 'last'"),
        (["engine.name='flower'", "audit.max_samples=3", "audit.pick='random'"],
         r"engine.options: the Flower engine sends an audited node a sample count, so audit.pick = 'random'"),
        (["engine.name='flower'", "engine.options.secagg.threshold_fraction=0"],
         r"engine 'flower'.secagg: secagg.threshold_fraction must be in \(0, 1\], got 0"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_error_before_any_work(tmp_path, capsys, overrides, message):
    out = tmp_path / "out"
    assert main(["run", RTF, *SMALL, *overrides, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(message, err), err
    assert not out.exists()  # no figure, no export, no store


def test_missing_public_data_is_found_before_the_fl_rounds(tmp_path, capsys, organamnist_only):
    out = tmp_path / "out"
    args = [f"experiment.data_root='{organamnist_only}'", "audit.public_dataset='pathmnist'", "fl.rounds=50"]
    assert main(["run", RTF, *SMALL, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pathmnist" in err and "Traceback" not in err
    assert not out.exists()

"""Progress bars: one switch for every long step; the ``gradleak`` command shows them unless ``--quiet``,
library calls are quiet unless asked, and the switch is restored after a command."""

from __future__ import annotations

from pathlib import Path

import torch

from gradleak import progress
from gradleak.attacks import create_attack
from gradleak.cli import main
from gradleak.federation import train_client
from gradleak.models import build_model
from gradleak.types import LocalTraining, Observation
from synthetic import synthetic_dataset

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "plugins" / "kidney_audit.toml"
FAST = ["fl.rounds=1", "data.train_limit=600", "data.test_limit=200", "audit.attacks.0.max_iterations=3"]


def observation() -> Observation:
    model = build_model("sme_cnn", (1, 12, 12), 3, seed=0)
    data = synthetic_dataset(n=2, shape=(1, 12, 12), classes=3, seed=0)
    result = train_client(0, model, data, LocalTraining("fedsgd", batch_size=2), [], torch.Generator())
    assert result.update is not None
    return Observation(model, result.update, (1, 12, 12), 3)


def test_an_attack_shows_its_bar_only_when_bars_are_on(capsys):
    obs = observation()
    create_attack("ig", max_iterations=3).reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert "IG" not in capsys.readouterr().err  # a library call is quiet by default
    with progress.bars(True):
        create_attack("ig", max_iterations=3).reconstruct(obs, generator=torch.Generator().manual_seed(0))
    err = capsys.readouterr().err
    assert "IG:" in err and "/3 [" in err  # the bar, with its total (tqdm clears it when done)
    assert not progress.enabled()  # restored after the block


def test_the_command_shows_bars_unless_quiet(tmp_path, capsys):
    assert main(["run", "--trust-config-plugins", str(CONFIG), *FAST, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "FL rounds" in err and "IG" in err
    assert (
        main(["--quiet", "run", "--trust-config-plugins", str(CONFIG), *FAST, "--out", str(tmp_path / "b")])
        == 0
    )
    err = capsys.readouterr().err
    assert "FL rounds" not in err and "IG" not in err
    assert not progress.enabled()  # the command does not leave the switch on

"""``flwr run examples/flower``: the example Flower app runs under Flower's own CLI (a local SuperLink in
simulation mode, 10 SuperNodes on Ray), its ServerApp's audit lands in gradleak's results store, and
``gradleak results`` shows it. The SuperLink runs on ports of its own and is stopped afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from gradleak.cli import main  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(600)
def test_flwr_run_of_the_example_app_is_audited_into_the_store(tmp_path, capsys):
    store = tmp_path / "flower.sqlite"
    http, control = free_port(), free_port()
    env = {
        **os.environ,
        "FLWR_HOME": str(tmp_path / "flwr"),
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control),
    }
    overrides = ["num-server-rounds=1", f'store="{store}"', "attack.max_iterations=3"]
    command = [str(BIN / "flwr"), "run", str(ROOT / "examples" / "flower"), "--stream",
               "--federation-config", "num-supernodes=10"]  # fmt: skip
    for item in overrides:
        command += ["--run-config", item]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540, check=False)
    finally:  # the local SuperLink flwr started in the background, on this test's ports
        subprocess.run(["pkill", "-f", f"flower-superlink.*--port {http}"], check=False)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, log
    (run,) = ResultStore(store).runs()
    attacks = ResultStore(store).records(run.run_id, "attack")
    assert len(attacks) == 2, log  # fraction-train 0.2 of 10 nodes, in the one audited round
    for a in attacks:
        assert a["attack"] == "sme" and a["options"] == {"max_iterations": 3} and a["round"] == 1
        assert a["iterations"] == 3 and a["num_samples"] == a["reconstructed"] > 0
        assert 0.0 <= a["matching_loss"] <= 2.0  # a cosine distance
    assert len({a["node_id"] for a in attacks}) == 2
    assert main(["results", str(store), "latest"]) == 0
    shown = capsys.readouterr().out
    assert run.run_id in shown and shown.count("| sme |") + shown.count("|    sme |") == 2, shown
    assert run.config["attacks"] == [{"name": "sme", "max_iterations": 3}]

"""examples/flower, the quickstart (issue 50, item 6): Flower's PyTorch quickstart shape (a BatchNorm CNN on
CIFAR-10, FedAvg, server-side evaluation) with gradleak added by ``gradleak.patch`` alone.

- The patch is exactly what separates the app from a plain Flower app: reversed, it leaves apps that
  import nothing of gradleak's audit or defenses; it adds at most 10 lines of Python and one config key;
  the README shows it verbatim.
- ``flwr run examples/flower`` (a local SuperLink in simulation mode, 4 SuperNodes on Ray, 3 rounds, its
  own ``FLWR_HOME`` and ports; what it started is stopped by PID afterwards) audits every reply of every
  round, scored with floors; ``gradleak report`` renders the run, and headless chromium shows a verdict for
  every node and round, the floors and the reconstructions, with no console error.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from browser import console_lines, probed_dom  # noqa: E402
from gradleak.cli import main  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.integrations.flower.cli_run import run_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "flower"
GRADLEAK_IMPORT = re.compile(r"^\s*(from|import) gradleak(\.| |$)", re.M)  # not gradleak_flower, the app


def added_lines(patch: str, suffix: str = "") -> list[str]:
    """The non-blank lines ``patch`` adds to files ending in ``suffix``."""
    out, current = [], ""
    for line in patch.splitlines():
        if line.startswith("+++ "):
            current = line[4:]
        elif line.startswith("+") and line[1:].strip() and current.endswith(suffix):
            out.append(line[1:])
    return out


def test_the_patch_is_all_gradleak_adds_to_a_plain_flower_app(tmp_path):
    patch = (APP / "gradleak.patch").read_text(encoding="utf-8")
    plain = tmp_path / "plain"
    shutil.copytree(APP, plain, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "apply", "-R", str(APP / "gradleak.patch")], cwd=plain, check=True)
    for name in ("client_app.py", "server_app.py"):
        source = (plain / "gradleak_flower" / name).read_text(encoding="utf-8")
        ast.parse(source)  # still a valid app
        assert GRADLEAK_IMPORT.search(source) is None, name
        assert GRADLEAK_IMPORT.search((APP / "gradleak_flower" / name).read_text(encoding="utf-8"))
    assert "audit-budget" not in (plain / "pyproject.toml").read_text(encoding="utf-8")
    python = added_lines(patch, ".py")
    assert len(python) <= 10, python
    assert len(added_lines(patch)) - len(python) == 1  # the one config key
    readme = (APP / "README.md").read_text(encoding="utf-8")
    (shown,) = re.findall(r"```diff\n(.*?)```", readme, re.S)
    assert shown == patch


@pytest.mark.timeout(900)
def test_flwr_run_of_the_quickstart_ends_in_a_report_with_a_verdict_for_every_node_and_round(tmp_path):
    home = tmp_path / "flwr"
    done = run_app(APP, home, supernodes=4, run_config=("audit-budget=6",), timeout=720)
    log = done.tail(4000)
    assert done.returncode == 0, log
    assert done.stopped, "flwr run left no SuperLink behind to stop: the test's bookkeeping is wrong"
    store = ResultStore(home / "audit.sqlite")  # a relative store is under FLWR_HOME
    (run,) = store.runs()
    assert store.records(run.run_id, "rejected") == []
    attacks = store.records(run.run_id, "attack")
    assert sorted(a["round"] for a in attacks) == [1, 1, 2, 2, 3, 3], log  # 2 of 4 nodes a round, all kept
    for a in attacks:
        assert a["attack"] == "pisme" and a["options"] == {"max_iterations": 6}  # "auto" at the budget
        assert a["num_samples"] == a["batch_size"] == 16  # scored against the node's 16 training images
        said = {k: a.get(k) for k in ("round", "node_id", "refused", "psnr_mean", "reconstructed", "figure")}
        assert a.get("floor_random_psnr_mean", 0) > 0 and "psnr_mean_beyond_floor" in a and a["figure"], said
    # the model moved in every round: the server's held-out loss differs after each
    evaluation = ast.literal_eval(done.stdout.split("server-side evaluation by round: ")[1].splitlines()[0])
    assert sorted(evaluation) == [0, 1, 2, 3] and len({m["loss"] for m in evaluation.values()}) == 4
    figures = home / "audit-figures" / run.run_id
    assert oct(figures.stat().st_mode & 0o777) == "0o700"
    out = tmp_path / "report.html"
    assert main(["report", str(home / "audit.sqlite"), "latest", "--figures", str(home / "audit-figures"),
                 "--out", str(out)]) == 0  # fmt: skip
    if not shutil.which("chromium"):
        pytest.skip("Debian's chromium is not installed (make browser): the report was written, not opened")
    dom = probed_dom(out, tmp_path)
    assert console_lines(dom) == []
    assert "images:6:loaded" in dom.stdout, dom.stdout[-500:]  # every reconstruction embedded and decoded
    verdicts = re.findall(r"<li>(round \d, node \d+: .*?)</li>", dom.stdout.split("node-verdicts")[1])
    assert len(verdicts) == 6 and all("(rule " in v for v in verdicts), verdicts
    assert "floor: random dB" in dom.stdout and "PSNR over floor" in dom.stdout

"""examples/flowertune (issue 52, item 1): a FlowerTune-shaped app, federated LoRA fine-tuning of a causal LM
with only the adapters on the wire, gradleak's defense mod in the ClientApp and its audit on the ServerApp,
run by ``flwr run`` (4 SuperNodes on Ray, 2 rounds, the GPT-2 arch tiny in place of SmolLM2).

What it must show: every reply audited (2 of 4 nodes a round), none rejected although a reply holds only
adapters; the audit reads the adapter deltas (dager_lora_fedavg: side B on round 1's fresh adapter) and
scores them against the node's sentences beside the norm-matched null, as the same attack does on the same
node's update computed in this process (within one token's ROUGE-1, 0.1: the Ray worker's thread count may
round differently; equal here); the report says the undefended federation leaks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from gradleak.cli import main  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.experiments.verdicts import verdict  # noqa: E402
from gradleak.integrations.flower.cli_run import run_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "flowertune"
TINY = ("model='gpt2_tiny'", "lora-r=32", "lora-alpha=64", "dataset-size=8", "batch-size=2", "max-tokens=10")


def in_process_rouge1(partition: int) -> float:
    """The slow obvious reference for round 1: the app's own model, data and training for ``partition``, the
    delta attacked and scored in this process (0.971 / 0.932 / 0.940 / 0.955 for partitions 0-3 measured:
    one SGD step, read with exact DAGER's settings; every token but each sentence's last, only a label)."""
    import copy
    import sys

    import torch

    from gradleak.attacks import create_attack
    from gradleak.audit import TextScorer
    from gradleak.types import LocalTraining, Observation, Update

    sys.path.insert(0, str(APP))
    try:
        from gradleak_flowertune.task import adapter_arrays, build, node_data, train
    finally:
        sys.path.remove(str(APP))
    model, tokenizer = build("gpt2_tiny", 32, 64)
    data = node_data(partition, 4, 8, tokenizer, 10)
    trained, w0 = copy.deepcopy(model), adapter_arrays(model)
    train(trained, data, 1, 2, 0.01)
    wt = adapter_arrays(trained)
    update = Update({k: wt[k] - w0[k] for k in w0}, len(data), "delta")
    obs = Observation(model.eval(), update, (10,), 2, training=LocalTraining("fedavg", 1, 2, 0.01))
    rec = create_attack("dager_lora_fedavg").reconstruct(obs, generator=torch.Generator())
    return float(TextScorer(tokenizer).score(rec, data)["rouge1"])


@pytest.mark.timeout(900)
def test_flwr_run_of_the_flowertune_app_audits_every_adapter_reply_and_finds_the_leak(tmp_path):
    home = tmp_path / "flwr"
    done = run_app(APP, home, supernodes=4, run_config=(*TINY, "defense='none'"), timeout=720)
    log = done.tail(4000)
    assert done.returncode == 0, log
    assert done.stopped, "flwr run left no SuperLink behind to stop"
    store = ResultStore(home / "audit.sqlite")
    (run,) = store.runs()
    for kind in ("rejected", "client_error", "attack_error"):
        assert store.records(run.run_id, kind) == [], kind
    attacks = store.records(run.run_id, "attack")
    assert sorted(a["round"] for a in attacks) == [1, 1, 2, 2], log
    first = [a for a in attacks if a["round"] == 1]
    for a in attacks:
        assert a["attack"] == "dager_lora_fedavg" and a["refused"] is None
        assert a["batch_size"] == 2 and a["floor_null_rouge1"] == 0.0  # the node's 2 sentences; null: nothing
    for a in first:  # a fresh adapter: peft's B = 0 in the broadcast model, read on side B
        assert a["side_b"] == 1.0 and a["partition_id"] in range(4), a
        assert a["rouge1"] == pytest.approx(in_process_rouge1(a["partition_id"]), abs=0.1), (
            a
        )  # one token either way
        assert verdict(a).startswith(f"round 1, node {a['node_id']}: LEAKS to dager_lora_fedavg")
    out = tmp_path / "report.html"
    assert main(["report", str(home / "audit.sqlite"), "latest", "--out", str(out)]) == 0
    html = out.read_text(encoding="utf-8")
    assert len(re.findall(r"LEAKS to dager_lora_fedavg: ROUGE-1", html)) >= 2

"""Benchmark plumbing: common options, the result record, fl_overhead's bare loop matching the engine."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

from gradleak.data.base import ImageDataset
from gradleak.fl import FederatedSimulation, FLConfig
from gradleak.models import build_model
from gradleak.types import LocalTraining

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helpers as `_common`

import fl_overhead  # noqa: E402

import _common  # noqa: E402


def test_parse_args_defaults_and_seeds() -> None:
    p = _common.make_parser("x")
    a = _common.parse_args(p, [])
    assert (a.scale, a.seeds, a.out, a.threads) == ("smoke", [0], _common.RESULTS_DIR, None)
    a = _common.parse_args(p, ["--scale", "small", "--seed", "3", "--seed", "1", "--seeds", "3", "7"])
    assert a.scale == "small" and a.seeds == [3, 1, 7]
    with pytest.raises(SystemExit):
        _common.parse_args(p, ["--scale", "huge"])


def test_write_result_records_provenance(tmp_path: Path) -> None:
    path = _common.write_result("demo", "smoke", {"ratio": 1.0}, seeds=[1, 2], out=tmp_path)
    assert path == tmp_path / "demo_smoke.json"
    assert [p.name for p in tmp_path.iterdir()] == ["demo_smoke.json"]  # no temp file left behind
    rec = json.loads(path.read_text())
    assert rec["benchmark"] == "demo" and rec["scale"] == "smoke" and rec["seeds"] == [1, 2]
    assert rec["result"] == {"ratio": 1.0}
    assert set(rec["git"]) == {"commit", "dirty"}
    assert {"platform", "cpu_count", "torch", "torch_threads"} <= set(rec["machine"])
    assert rec["command"] and rec["timestamp"]
    with pytest.raises(ValueError):
        _common.write_result("demo", "huge", {}, seeds=[0], out=tmp_path)
    with pytest.raises(ValueError):  # NaN is not JSON
        _common.write_result("demo", "smoke", {"x": float("nan")}, seeds=[0], out=tmp_path)
    assert json.loads(path.read_text())["result"] == {"ratio": 1.0}  # a failed write leaves the old file


def test_summarize() -> None:
    s = _common.summarize([3.0, 1.0, 2.0, 4.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0 and s["n"] == 4


def test_bare_round_matches_engine() -> None:
    g = torch.Generator().manual_seed(0)
    clients = [
        ImageDataset("syn", torch.rand(n, 1, 12, 12, generator=g), torch.randint(0, 3, (n,), generator=g), 3)
        for n in (20, 33, 9, 15)
    ]
    training = LocalTraining(epochs=2, batch_size=8, lr=1e-3, optimizer="adam")
    model = build_model("aegis_cnn", (1, 12, 12), 3, seed=0, width=4, hidden=16)
    bare = copy.deepcopy(model)
    work = copy.deepcopy(model)
    sim = FederatedSimulation(model, clients, FLConfig(fraction=0.5, training=training), seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add contention on a busy machine
    try:
        for r in range(2):
            ids = sim.run_round(r).client_ids
            fl_overhead.bare_round(bare, work, clients, ids, seed=5, round_idx=r, training=training)
    finally:
        torch.set_num_threads(threads)
    assert fl_overhead.max_abs_diff(sim.model, bare) <= 1e-6

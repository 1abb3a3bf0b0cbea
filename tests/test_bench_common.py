"""Benchmark plumbing: common options, the result record, fl_overhead's bare loop matching the engine."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
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


def test_rr_beyond_prior_counts_only_images_clearly_above_the_public_mean() -> None:
    import linear_leakage as ll

    r = ll.RegimeResult("r", "a", {}, {}, False, images=4, matched=3)
    r.psnr, r.ssim = [30.0, 20.0, 10.0], [0.9, 0.5, 0.1]
    r.prior_psnr = [10.0, 19.0, 5.0]  # image 1 is above 18 dB but within 3 dB of the mean image
    r.recovery_seconds, r.step_seconds = [1.0], [1.0]
    s = r.summary()
    assert s["reconstruction_rate"] == pytest.approx(2 / 4)  # the unmatched image counts as a failure
    assert s["rr_beyond_prior"] == pytest.approx(1 / 4)
    assert s["prior_margin_db"] == ll.PRIOR_MARGIN_DB == 3.0


def test_rr_beyond_class_prior_uses_the_public_mean_of_each_images_own_class() -> None:
    import linear_leakage as ll

    r = ll.RegimeResult("r", "a", {}, {}, False, images=3, matched=3)
    r.psnr, r.ssim = [30.0, 25.0, 25.0], [0.9, 0.8, 0.8]
    r.prior_psnr = [10.0, 10.0, 10.0]  # all three clearly above the global mean image
    r.recovery_seconds, r.step_seconds = [1.0], [1.0]
    assert r.summary()["rr_beyond_class_prior"] is None  # no class priors recorded: not reported
    r.class_prior_psnr = [20.0, 23.0, 21.9]  # image 1 is within 3 dB of its class mean, image 2 just above
    s = r.summary()
    assert s["rr_beyond_prior"] == pytest.approx(1.0)
    assert s["rr_beyond_class_prior"] == pytest.approx(2 / 3)
    assert s["per_image_class_prior_psnr"] == [20.0, 23.0, 21.9]


def test_score_regime_records_the_class_mean_prior_of_each_matched_image(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import linear_leakage as ll
    from gradleak.fl.client import ClientResult
    from gradleak.types import Reconstruction

    # public: class 0 dark (0.2), class 1 bright (0.8), global mean 0.5
    public = torch.cat([torch.full((4, 1, 12, 12), 0.2), torch.full((4, 1, 12, 12), 0.8)])
    public_labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    truth = torch.stack([torch.full((1, 12, 12), v) for v in (0.25, 0.75, 0.45)])
    labels = torch.tensor([0, 1, 2])  # class 2 is absent from the public data: the global mean is its prior

    class Echo:  # returns the two class means and an exact copy of image 2, whatever the update
        def reconstruct(self, obs: object, *, generator: torch.Generator) -> Reconstruction:
            return Reconstruction(images=torch.stack([public[0], public[4], truth[2]]))

    monkeypatch.setattr(ll, "server_view", lambda *a, **k: [object()])
    out = ll.RegimeResult("r", "a", {}, {}, False, step_seconds=[1.0])
    res = ClientResult(0, None, ImageDataset("c", truth, labels, 3))
    ll.score_regime(out, Echo(), None, {}, [res], [truth], (1, 12, 12), 3, False, 0, public, public_labels)  # type: ignore[arg-type]
    assert out.psnr == pytest.approx([26.02, 26.02, 100.0], abs=0.01)
    assert out.prior_psnr == pytest.approx([12.04, 12.04, 26.02], abs=0.01)  # vs the global mean 0.5
    assert out.class_prior_psnr == pytest.approx([26.02, 26.02, 26.02], abs=0.01)  # vs 0.2, 0.8, 0.5
    s = out.summary()
    assert s["rr_beyond_prior"] == pytest.approx(1.0)  # every image > 18 dB and > 3 dB above the mean image
    assert s["rr_beyond_class_prior"] == pytest.approx(1 / 3)  # the class means tell nothing new


def test_run_state_round_trip_and_refuses_another_runs_state(tmp_path: Path) -> None:
    path = tmp_path / "state" / "run.safetensors"
    assert _common.load_state(path, {"seed": 0}) is None  # nothing saved yet
    model = torch.nn.Linear(3, 2)
    rows = [{"round": 0, "acc": 0.25, "clients": [3, 7]}]
    stats = {17: {"accepted": 2048, "budget": 0.5}}  # int keys (client ids) come back as ints
    state = {"rounds": rows, "models": {"none": model.state_dict()}, "cache_stats": stats}
    _common.save_state(path, {"seed": 0, "dataset": "x"}, state)
    assert [p.name for p in path.parent.iterdir()] == ["run.safetensors"]  # no temp file left behind
    assert path.read_bytes()[:1] != b"\x80"  # not a pickle
    state = _common.load_state(path, {"seed": 0, "dataset": "x"})
    assert state is not None and state["rounds"] == rows and state["cache_stats"] == stats
    assert all(torch.equal(state["models"]["none"][k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"\['seed'\]"):  # a state of seed 0 does not resume seed 1
        _common.load_state(path, {"seed": 1, "dataset": "x"})


def test_oracle_cache_draws_other_clients_images_of_the_clients_labels() -> None:
    import aegis_table2  # heavy: imports the attack benchmarks

    labels = torch.arange(4).repeat_interleave(500)  # 4 classes, 500 images each
    # each image's pixels encode its index, as a pixel in [0, 1]: i / 2048 is exact in float32
    ids_as_pixels = torch.arange(len(labels), dtype=torch.float32) / 2048
    images = ids_as_pixels.view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()
    pool = ImageDataset("toy", images, labels, 4)
    part = np.concatenate([np.arange(0, 30), np.arange(500, 510)])  # client: 30 of class 0, 10 of class 1
    share = pool.subset(part)
    cache = aegis_table2.oracle_cache(
        pool.subset(aegis_table2.other_clients(pool, part).numpy()), share, 400, 0, 3
    )
    ids = (cache.images[:, 0, 0, 0] * 2048).round().long()
    assert len(cache) == 400 and len(set(ids.tolist())) == 400  # distinct pool images
    assert not set(ids.tolist()) & set(part.tolist())  # none of the client's own
    assert torch.equal(pool.labels[ids], cache.labels)  # labels belong to the images
    counts = torch.bincount(cache.labels, minlength=4)
    assert counts[2:].sum() == 0  # only the client's classes
    assert abs(int(counts[0]) - 300) <= 40  # 3:1 like the client's share (binomial sd ~ 8.7)
    again = aegis_table2.oracle_cache(
        pool.subset(aegis_table2.other_clients(pool, part).numpy()), share, 400, 0, 3
    )
    assert torch.equal(again.images, cache.images)  # seeded

"""What an operator sees of a Flower audit (issue 50): the store's counts are right (the rounds audited, the
updates attacked, not every record), ``gradleak report`` and ``gradleak results`` take ``latest``, the
audit bounds torch's threads for its own work and restores them, and ``partitions=`` keys the truth on the
server's side (a client's reported ``partition-id`` cannot choose whose data scores its update)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flowergrid import AppGrid  # noqa: E402
from flowergrid import server_identity as flower_server_identity  # noqa: E402
from gradleak.cli import main  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.integrations.flower import (
    AuditStrategy,  # noqa: E402
    auditing,  # noqa: E402
)
from gradleak.models import build_model  # noqa: E402
from synthetic import synthetic_dataset  # noqa: E402

SHAPE, CLASSES = (1, 12, 12), 3
NODES = (21, 22)
DATA = {
    k: synthetic_dataset(n=2 + k, shape=SHAPE, classes=CLASSES, seed=k) for k in range(2)
}  # 2 and 3 images


def model():
    return build_model("sme_cnn", SHAPE, CLASSES, seed=0)


@pytest.fixture(autouse=True)
def server_identity():
    with flower_server_identity(0):
        yield


def app(claim: int | None = None):
    """One SGD step on the node's partition; it reports ``claim`` as its partition-id when given."""

    def train(msg: Message, ctx) -> Message:
        k = int(ctx.node_config["partition-id"])
        net = model()
        net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        F.cross_entropy(net(DATA[k].images), DATA[k].labels).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.1 * p.grad
        metrics = MetricRecord({"num-examples": len(DATA[k]), "partition-id": k if claim is None else claim})
        content = RecordDict({"arrays": ArrayRecord(torch_state_dict=net.state_dict()), "metrics": metrics})
        return Message(content, reply_to=msg)

    return train


def audit(tmp_path, rounds=2, **options):
    store = ResultStore(tmp_path / "a.sqlite")
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), model=model(),
        attacks=[("ig", {"max_iterations": 2})], input_shape=SHAPE, num_classes=CLASSES, store=store,
        **options,
    )  # fmt: skip
    return strategy, store


def test_the_store_counts_rounds_and_attacked_updates_and_latest_works(tmp_path, capsys):
    strategy, store = audit(tmp_path)
    grid = AppGrid(dict.fromkeys(NODES, app()), NODES)
    strategy.start(grid, ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=2)
    (run,) = store.runs()
    (summary,) = store.records(run.run_id, "summary")
    assert summary["audited"] == 4 and summary["rounds"] == 2 and summary["attack_records"] == 4
    assert main(["results", str(tmp_path / "a.sqlite")]) == 0
    listing = capsys.readouterr().out
    row = next(line for line in listing.splitlines() if run.run_id in line)
    assert [c.strip() for c in row.strip("|").split("|")][4:6] == ["2", "4"]  # rounds, attack records
    assert main(["results", str(tmp_path / "a.sqlite"), "latest"]) == 0
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "a.sqlite"), "latest", "--out", str(out)]) == 0
    assert run.run_id in out.read_text(encoding="utf-8")


def test_the_audit_bounds_torch_threads_for_its_own_work_and_restores_them(tmp_path, monkeypatch):
    seen = []
    real = auditing.attack_update

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(auditing, "attack_update", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        strategy, _ = audit(tmp_path, threads=1)
        grid = AppGrid(dict.fromkeys(NODES, app()), NODES)
        strategy.start(grid, ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=1)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_partitions_key_the_truth_on_the_servers_side(tmp_path):
    # both nodes claim partition 0; the server's map says node 22 holds partition 1
    strategy, store = audit(tmp_path, truth=DATA.get, partitions={21: 0, 22: 1})
    grid = AppGrid(dict.fromkeys(NODES, app(claim=0)), NODES)
    strategy.start(grid, ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=1)
    (run,) = store.runs()
    records = {r["node_id"]: r for r in store.records(run.run_id, "attack")}
    assert records[21]["partition_id"] == records[22]["partition_id"] == 0  # what each claimed
    # scored against the map's data: partition 1's 3 images for node 22, not the 2 of the partition it claimed
    assert records[22]["batch_size"] == 3 and records[21]["batch_size"] == 2 and "psnr" in records[22]
    claimed_only, _ = audit(tmp_path / "b", truth=DATA.get)
    assert claimed_only.partitions is None


def test_auto_picks_the_attack_for_the_recipe_and_small_budgets_are_warned_in_the_report(tmp_path, caplog):
    from gradleak.audit.choice import auto_attacks
    from gradleak.types import LocalTraining

    fedavg, fedsgd = LocalTraining("fedavg", batch_size=2), LocalTraining("fedsgd", batch_size=2)
    assert [s.name for s in auto_attacks(model(), fedavg)[0]] == ["pisme"]
    assert [s.name for s in auto_attacks(model(), fedsgd)[0]] == ["ig"]
    assert [s.name for s in auto_attacks(model(), None)[0]] == ["ig"]
    text = build_model("gpt2_tiny", (16,), 2, seed=0)
    assert [s.name for s in auto_attacks(text, fedavg)[0]] == ["dager", "embedding_norm"]
    strategy = AuditStrategy(FedAvg(), model=model(), attacks="auto", input_shape=SHAPE, num_classes=CLASSES,
                             training=fedavg)  # fmt: skip
    assert [s.name for s in strategy.attacks] == ["pisme"] and "FedAvg" in strategy.choice
    quick = AuditStrategy(FedAvg(), model=model(), attacks=[("auto", {"budget": 40})], input_shape=SHAPE,
                          num_classes=CLASSES, training=fedsgd)  # fmt: skip
    assert [(s.name, dict(s.options)) for s in quick.attacks] == [("ig", {"max_iterations": 40})]
    assert [(s.name, dict(s.options)) for s in auto_attacks(text, fedavg, 40)[0]] == [
        ("dager", {}),
        ("embedding_norm", {}),
    ]  # fmt: skip  (no budget to set)
    for bad in ([("auto", {"lr": 0.1})], [("auto", {}), "ig"], [("auto", {"budget": 0})]):
        with pytest.raises(ValueError, match="auto"):
            AuditStrategy(FedAvg(), model=model(), attacks=bad, input_shape=SHAPE, num_classes=CLASSES)
    with caplog.at_level("WARNING"):
        strategy, store = audit(tmp_path)  # IG at 2 iterations: a thousandth of its default
    assert "ig: max_iterations = 2 is below a quarter of its default 2000" in caplog.text
    grid = AppGrid(dict.fromkeys(NODES, app()), NODES)
    strategy.start(grid, ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=1)
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "a.sqlite"), "--out", str(out)]) == 0
    assert "Warning: [budget] ig: max_iterations = 2 is below a quarter" in out.read_text(encoding="utf-8")
    (run,) = store.runs()  # no truth: each record carries the truth-free fit margin, and its verdict says so
    records = store.records(run.run_id, "attack")
    assert records and all(r["fit_margin"] == r["null_matching_loss"] - r["matching_loss"] for r in records)
    assert "better than norm-matched noise" in out.read_text(encoding="utf-8")


def test_reconstructions_are_saved_for_the_operator_privately_and_embedded_in_the_report(tmp_path):
    import stat

    strategy, store = audit(tmp_path, figures=tmp_path / "figs", truth=DATA.get)
    grid = AppGrid(dict.fromkeys(NODES, app()), NODES)
    strategy.start(grid, ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=1)
    (run,) = store.runs()
    records = store.records(run.run_id, "attack")
    folder = tmp_path / "figs" / run.run_id
    files = sorted(p.name for p in folder.iterdir())
    assert (
        files
        == sorted(r["figure"] for r in records)
        == ["reconstructions_0_0.png", "reconstructions_0_1.png"]
    )
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((folder / f).stat().st_mode) == 0o600 for f in files)
    out = tmp_path / "r.html"
    assert (
        main(["report", str(tmp_path / "a.sqlite"), "--figures", str(tmp_path / "figs"), "--out", str(out)])
        == 0
    )
    assert out.read_text(encoding="utf-8").count("data:image/png;base64") == 2
    html = out.read_text(encoding="utf-8")
    lines = html.split("<ul id='node-verdicts'>")[1].split("</ul>")[0].count("<li>")
    assert lines == len(records) == 2  # one verdict line per attacked reply
    assert "rule 4" in html  # the node's data, no public split: the raw score, and what a floor needs


def test_truth_may_be_the_apps_own_loader_of_dict_batches_and_scores_as_the_data_set(tmp_path):
    """``truth=`` returning the app's DataLoader (Flower quickstart's ``{"img", "label"}`` batches)
    gives the records the ImageDataset gives (the same samples in the same order)."""
    from torch.utils.data import DataLoader

    def loader(k: int) -> DataLoader:
        rows = [{"img": x, "label": y} for x, y in zip(DATA[k].images, DATA[k].labels, strict=True)]
        return DataLoader(rows, batch_size=2)

    records = []
    for name, truth in (("set", DATA.get), ("loader", loader)):
        random.seed(0)  # Flower's FedAvg samples the nodes with random: the same order, the same seeds
        strategy, store = audit(tmp_path / name, truth=truth)
        strategy.start(AppGrid(dict.fromkeys(NODES, app()), NODES),
                       ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=1)  # fmt: skip
        (run,) = store.runs()
        records.append(sorted(store.records(run.run_id, "attack"), key=lambda r: r["node_id"]))
    assert [r["batch_size"] for r in records[1]] == [2, 3]
    for a, b in zip(*records, strict=True):
        for key in ("psnr", "ssim", "matching_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    from gradleak.data.base import ImageDataset

    with pytest.raises(ValueError, match="one \\(B, C, H, W\\) float tensor and one \\(B,\\) integer"):
        ImageDataset.from_batches("bad", [{"img": DATA[0].images, "mask": DATA[0].images}], CLASSES)


def test_public_images_give_the_floors_and_a_normalising_pipeline_is_refused_before_round_1(tmp_path):
    """``public=`` (the server's labelled images, here its own loader) scores each update beside the null
    floors; a loader that yields normalised images is refused when the wrapper is built, naming the fix."""
    from torch.utils.data import DataLoader, TensorDataset

    public = synthetic_dataset(n=12, shape=SHAPE, classes=CLASSES, seed=7)
    loader = DataLoader(TensorDataset(public.images, public.labels), batch_size=5)
    strategy, store = audit(tmp_path, truth=DATA.get, public=loader)
    strategy.start(AppGrid(dict.fromkeys(NODES, app()), NODES),
                   ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=1)  # fmt: skip
    (run,) = store.runs()
    for r in store.records(run.run_id, "attack"):
        higher = max(r["floor_random_psnr_mean"], r["floor_class_mean_psnr_mean"])
        assert r["psnr_mean_beyond_floor"] == pytest.approx(r["psnr_mean"] - higher, abs=1e-9)
    normalised = DataLoader(TensorDataset((public.images - 0.5) / 0.25, public.labels), batch_size=5)
    with pytest.raises(ValueError, match="normalise inside its forward"):
        audit(tmp_path / "n", public=normalised)


def test_a_truth_that_fails_for_a_clients_claim_never_stops_the_audit(tmp_path):
    """The truth key may be a client's claim: a negative one, or one the user's loader fails on, leaves
    that update scored without truth (the reason in its record) and the federation going."""

    def fragile(k: int):
        if k == 1:
            raise IndexError("no partition 1 here")
        return DATA[k]

    nodes = {21: app(claim=-3), 22: app()}  # node 21 claims partition -3, node 22 its own, 1
    strategy, store = audit(tmp_path, truth=fragile)
    strategy.start(AppGrid(nodes, NODES), ArrayRecord(torch_state_dict=model().state_dict()), num_rounds=1)
    (run,) = store.runs()
    records = {r["node_id"]: r for r in store.records(run.run_id, "attack")}
    assert records[21]["truth_error"] == "no truth for the negative key -3" and "psnr" not in records[21]
    assert records[22]["truth_error"].startswith("truth(1) failed: IndexError: no partition 1 here")
    assert "fit_margin" in records[22] and run.status == "complete"

"""AuditStrategy over a federation that exchanges only LoRA adapters (FlowerTune's apps send only their
adapters): the adapter-only arrays are accepted and attacked, the frozen base stays the server's, and a
client that slips base weights into its reply is rejected and left out of the aggregate, as is a reply that
drops an adapter. Flower's own FedAvg and round loop over in-process ClientApps (no Ray)."""

from __future__ import annotations

import itertools

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from flowergrid import AppGrid  # noqa: E402
from flowergrid import server_identity as flower_server_identity  # noqa: E402
from gradleak.data.text import TextDataset, TokenDataset  # noqa: E402
from gradleak.experiments.store import ResultStore  # noqa: E402
from gradleak.integrations.flower import AuditStrategy  # noqa: E402
from gradleak.models.adapters import AdapterConfig, apply_adapter  # noqa: E402
from gradleak.models.text import build_gpt2  # noqa: E402
from gradleak.validation import trainable_of  # noqa: E402

TEXTS = ("the movie was surprisingly good", "a dull and lifeless film .", "an honest , moving story",
         "nothing works here", "a triumph", "too long by half")  # fmt: skip
NODES = (21, 22, 23)
BASE = "base_model.model.transformer.wte.weight"
ALIAS = "base_model.model.lm_head.weight"  # tied to BASE: one storage, two state_dict names


@pytest.fixture(scope="module")
def tiny():
    tm = build_gpt2("tiny", "causal_lm", seed=0)
    model = apply_adapter(tm.model, AdapterConfig(r=16, alpha=32, target=["attention"]), "causal_lm", seed=0)
    return model, tm.tokenizer


@pytest.fixture(autouse=True)
def server_identity():
    with flower_server_identity(0):
        yield


def adapters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in trainable_of(model)}


def grid(model, tokenizer, cheat: dict[int, str]) -> AppGrid:
    """Each node trains the adapters one SGD step on its 2 sentences; ``cheat[node]``: "base" adds a changed
    base weight to the reply, "drop" leaves an adapter out."""
    import copy

    def app(msg: Message, ctx) -> Message:
        node = msg.metadata.dst_node_id
        local = copy.deepcopy(model)
        local.load_state_dict({**local.state_dict(), **msg.content["arrays"].to_torch_state_dict()})
        k = NODES.index(node)
        data = TokenDataset.from_texts(TextDataset("t", TEXTS[2 * k : 2 * k + 2]), tokenizer, max_tokens=10)
        batch = data.batch()
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
        opt = torch.optim.SGD([p for p in local.parameters() if p.requires_grad], lr=0.01)
        local(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss.backward()
        opt.step()
        whole = len(msg.content["arrays"]) > len(trainable_of(model))  # the server sent the whole state
        arrays = {k: v.detach().clone() for k, v in local.state_dict().items()} if whole else adapters(local)
        if cheat.get(node) == "base":
            arrays[BASE] = local.state_dict()[BASE] + 1.0
        if cheat.get(node) == "alias":
            arrays[ALIAS] = local.state_dict()[ALIAS] + 1.0
        if cheat.get(node) == "drop":
            arrays.pop(next(iter(arrays)))
        content = RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": 2})})
        return Message(content, reply_to=msg)

    return AppGrid(dict.fromkeys(NODES, app), NODES)


def audited(model, tmp_path) -> tuple[AuditStrategy, ResultStore]:
    store = ResultStore(tmp_path / "audit.sqlite")
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), model=model,
        attacks=["dager_lora_fedavg"], input_shape=(10,), num_classes=2, store=store,
    )  # fmt: skip
    return strategy, store


def test_an_adapter_only_federation_is_audited_and_a_reply_with_base_weights_is_rejected(tiny, tmp_path):
    model, tokenizer = tiny
    strategy, store = audited(model, tmp_path)
    start = adapters(model)
    cheats = grid(model, tokenizer, {22: "base", 23: "drop"})
    result = strategy.start(cheats, ArrayRecord(start), num_rounds=1, timeout=60)
    (run,) = store.runs()
    rejected = store.records(run.run_id, "rejected")
    assert sorted(r["node_id"] for r in rejected) == [22, 23]
    assert BASE in next(r["error"] for r in rejected if r["node_id"] == 22)
    (attacked,) = store.records(run.run_id, "attack")  # node 21's adapters, read on side B (fresh adapter)
    assert attacked["node_id"] == 21 and attacked["side_b"] == 1.0 and attacked["reconstructed"] == 2
    final = result.arrays.to_torch_state_dict()
    assert set(final) == set(start)  # still only adapters: the base never entered the aggregate
    # the aggregate is node 21's reply alone (the two cheats left out): recomputed here from the same start
    honest = grid(model, tokenizer, {})
    msg = honest.create_message(RecordDict({"arrays": ArrayRecord(start)}), MessageType.TRAIN, 21, "")
    reply = honest.apps[21](msg, None).content["arrays"].to_torch_state_dict()
    for k in start:
        torch.testing.assert_close(final[k], reply[k], rtol=1e-6, atol=0)
    assert any(not torch.equal(final[k], start[k]) for k in start)


def test_a_federation_that_sends_the_whole_state_still_keeps_the_frozen_base_frozen(tiny, tmp_path):
    """The whole state_dict on the wire (allowed): a reply that moves a frozen base weight, or only its tied
    alias (GPT-2's lm_head.weight shares wte's storage), is not aggregated as sent: those arrays are set
    back to what was sent and the reply is recorded as sanitised, so no client steers the base (and a
    client's noise mod, which moves every array, does not get honest replies rejected); every reply is
    still attacked."""
    model, tokenizer = tiny
    strategy, store = audited(model, tmp_path)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cheats = grid(model, tokenizer, {22: "base", 23: "alias"})
    result = strategy.start(cheats, ArrayRecord(start), num_rounds=1, timeout=60)
    (run,) = store.runs()
    assert store.records(run.run_id, "rejected") == []
    notes = {r["node_id"]: r["frozen_reset"] for r in store.records(run.run_id, "sanitised")}
    assert set(notes) == {22, 23} and BASE in notes[22] and ALIAS in notes[23], notes
    assert sorted(a["node_id"] for a in store.records(run.run_id, "attack")) == [21, 22, 23]
    final = result.arrays.to_torch_state_dict()
    for key in (BASE, ALIAS):  # FedAvg's weighted mean of equal arrays rounds; a +1 cheat would move 1/3
        torch.testing.assert_close(final[key], start[key], rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(final[k], start[k]) for k in adapters(model))  # the adapters trained


def test_arrays_that_are_neither_the_state_dict_nor_the_adapters_are_refused(tiny):
    model, _ = tiny
    strategy = AuditStrategy(FedAvg(), model=model, attacks=["dager_lora_fedavg"], input_shape=(10,),
                             num_classes=2)  # fmt: skip
    partial = dict(list(adapters(model).items())[:-1])
    with pytest.raises(
        ValueError,
        match=r"neither the audited model's state_dict nor \(with frozen parameters\) its trainable.*lora_B",
    ):
        strategy.exchanged_names(1, partial)
    assert strategy.exchanged_names(1, model.state_dict()) == set(model.state_dict())  # whole: accepted too


def test_a_malicious_server_plants_peftleak_in_a_whole_state_lora_federation(tmp_path):
    """The server ships the backbone (the whole state on the wire): AuditStrategy's malicious option sends
    one node peftleak_lora's pass-through model (a text attack: no public images), attacks its reply against
    that model, and keeps it out of the aggregate; what it recovers is in that node's batch and nothing
    else, and the honest nodes' adapters alone make the aggregate."""
    tm = build_gpt2("tiny", "causal_lm", seed=0)
    model = apply_adapter(tm.model, AdapterConfig(r=16, alpha=32, target=["attention", "mlp"]), "causal_lm",
                          seed=0)  # fmt: skip
    from gradleak.audit import TextScorer

    def node_data(node: int) -> TokenDataset:  # the sentences grid() gives each node
        k = NODES.index(node)
        return TokenDataset.from_texts(
            TextDataset("t", TEXTS[2 * k : 2 * k + 2]), tm.tokenizer, max_tokens=10
        )

    store = ResultStore(tmp_path / "audit.sqlite")
    strategy = AuditStrategy(
        FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), model=model,
        attacks=["dager_lora_fedavg"], input_shape=(10,), num_classes=2, store=store,
        malicious=("peftleak_lora", {}), malicious_nodes=1, truth=node_data, scorer=TextScorer(tm.tokenizer),
    )  # fmt: skip
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = strategy.start(grid(model, tm.tokenizer, {}), ArrayRecord(start), num_rounds=1, timeout=60)
    (run,) = store.runs()
    planted = [r for r in store.records(run.run_id, "attack") if r["attack"] == "peftleak_lora"]
    assert len(planted) == 1 and planted[0]["recovered"] >= 3, planted
    batch = node_data(planted[0]["node_id"]).batch()  # the first node Flower sampled
    visible = {t for s in batch.sequences() for t in s[:-1]}  # a causal LM's last token is only a label
    assert planted[0]["rouge1"] > planted[0]["floor_null_rouge1"] == 0.0
    # the record keeps the recovered set decoded in id order: the decoding of some of the visible tokens
    (text,) = planted[0]["texts"]
    subsets = itertools.combinations(sorted(visible), int(planted[0]["recovered"]))  # 6 visible here
    assert any(tm.tokenizer.decode(list(s)).strip() == text for s in subsets), (text, visible)
    final = result.arrays.to_torch_state_dict()
    for key in (BASE, "base_model.model.transformer.h.0.attn.c_proj.base_layer.weight"):  # planted zeros: out
        torch.testing.assert_close(final[key], start[key], rtol=1e-6, atol=1e-7)

"""Peeling held sentences off a FedSGD gradient (``attacks/text/dager/peel.py``).

The reference is the slow, obvious one: what is left after peeling must equal the gradient the client would
have sent for the missing sentences alone (``fedsgd_text_update`` on them, weighted by their share of the
batch). An update that is not the batch's plain mean gradient must not be peeled at all.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from gradleak.attacks.text.dager.core import Dager, DagerConfig, EncoderSearch
from gradleak.attacks.text.dager.search import L2Search
from gradleak.attacks.text.family import estimate_span, find_module, input_side_gradient
from gradleak.data.text import encode, load_text_dataset, sample
from gradleak.models.text import build_text_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation

TEXTS = ("the movie was surprisingly good", "a dull and lifeless film .")
# float32 gradients recomputed one sentence at a time against the batch's: relative Frobenius error
TOL = 1e-4


def _parts(tm, obs, dager=None, screen_tokens=None):
    """The attack, its model copy, spec, block-1 module and an L2 search on block 2's full span (with the
    feed-forward screen over a block-1 table of ``screen_tokens``, where given)."""
    dager = dager or Dager()
    model = dager.attacker_model(obs)
    spec = dager.spec(model)
    m1, m2 = (find_module(model, spec.attn_inputs[0].format(i=i))[1] for i in (0, 1))
    span2 = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
    search = L2Search(model, m2, span2, spec.l2_threshold, first=m1)
    if screen_tokens is not None:
        search.tabulate(screen_tokens, obs.input_shape[0])
        search.screen = dager.feed_forward_span(obs, model, search, spec, span2)
        assert search.screen is not None
    return dager, model, spec, m1, search


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _observe(tm, texts, labels, max_tokens=32):
    batch = encode(list(texts), tm.tokenizer, max_tokens=max_tokens, labels=labels)
    update = fedsgd_text_update(tm.model, batch, "classification")
    return Observation(tm.model, update, (batch.input_ids.shape[1],), 2), batch.sequences()


@pytest.fixture(scope="module")
def wikitext_minilm():
    tm = build_text_model("minilm", "classification", seed=0)
    texts = list(sample(load_text_dataset("wikitext2", split="test"), 8, seed=0).texts)
    obs, seqs = _observe(tm, texts, [0] * 8)
    return tm, texts, obs, seqs


def test_what_is_left_is_the_missing_sentences_own_gradient(wikitext_minilm):
    """Six of eight WikiText-2 sentences peeled: the rest equals 2 / 8 of the two missing sentences'
    own FedSGD gradient, and block 2's span has exactly their token count as its rank."""
    tm, texts, obs, seqs = wikitext_minilm
    tokens = sorted({t for s in seqs for t in s})
    dager, model, spec, _, search = _parts(tm, obs, screen_tokens=tokens)
    peeler = dager.peeler(obs, model, spec, search)
    assert peeler is not None and set(peeler.rest) == {"l1", "l2", "ffn"}
    assert peeler.peel(seqs[:6]) == seqs[:6]
    assert peeler.peel(seqs[:6]) == []  # peeled once
    alone, _ = _observe(tm, texts[6:], [0, 0])
    for key, layer in (("l1", 0), ("l2", 1)):
        ref = input_side_gradient(alone, tm.model, spec.attn_inputs, layer) * 2 / 8
        assert _rel(peeler.rest[key], ref) < TOL
    ffn = "bert.encoder.layer.0.intermediate.dense.weight"
    assert _rel(peeler.rest["ffn"], alone.update.tensors[ffn].T.double() * 2 / 8) < TOL
    missing = len(seqs[6]) + len(seqs[7])
    assert peeler.rank == peeler.span("l2").rank == peeler.span("ffn").rank == missing


def test_with_one_sentence_left_the_l1_filter_reads_it_position_by_position(wikitext_minilm):
    """On the full update MiniLM's L1 filter passes (nearly) every batch token at every position; with
    seven sentences peeled it passes exactly the missing sentence's token at each of its positions."""
    tm, _, obs, seqs = wikitext_minilm
    dager, model, spec, m1, search = _parts(tm, obs)
    peeler = dager.peeler(obs, model, spec, search)
    assert peeler is not None
    vocab = sorted({t for s in seqs for t in s})
    out = dager.peel_held(peeler, search, model, spec, m1, seqs[:7], [vocab] * 32)
    assert out is not None
    cands, peeled = out
    assert peeled == seqs[:7]
    assert cands == [[t] for t in seqs[7]]
    assert search.span.rank == len(seqs[7])  # the search now checks against what is left
    assert dager.peel_held(peeler, search, model, spec, m1, seqs[:7], cands) is None  # nothing new


def test_a_sentence_peels_under_its_own_label_only(bert_cls):
    """Labels 1, 0: class 0 is tried first for the first sentence and must be refused (it leaves a
    remainder of that sentence's rank); what is left is the second sentence's gradient at label 0."""
    obs, seqs = _observe(bert_cls, TEXTS, [1, 0])
    dager, model, spec, _, search = _parts(bert_cls, obs)
    peeler = dager.peeler(obs, model, spec, search)
    assert peeler is not None
    assert peeler.peel([seqs[0]]) == [seqs[0]]
    alone, _ = _observe(bert_cls, TEXTS[1:], [0])
    for key, layer in (("l1", 0), ("l2", 1)):
        ref = input_side_gradient(alone, bert_cls.model, spec.attn_inputs, layer) / 2
        assert _rel(peeler.rest[key], ref) < TOL


def test_an_update_that_is_not_the_plain_mean_gradient_is_not_peeled(bert_cls):
    """An update scaled by 1.5 (a sum over another batch size, a server-side weighting) is no sum of the
    sentences' terms at weight 1 / B: no class lowers block 2's rank by the sentence's length, so nothing
    is subtracted and the attack searches the update as it came."""
    exact, seqs = _observe(bert_cls, TEXTS, [1, 0])
    update = exact.update
    scaled = dataclasses.replace(update, tensors={k: 1.5 * v for k, v in update.tensors.items()})
    obs = dataclasses.replace(exact, update=scaled)
    dager, model, spec, _, search = _parts(bert_cls, obs)
    peeler = dager.peeler(obs, model, spec, search)
    assert peeler is not None
    before = {k: v.clone() for k, v in peeler.rest.items()}
    assert peeler.peel(seqs) == []
    assert all(torch.equal(peeler.rest[k], before[k]) for k in before)
    assert peeler.refused == seqs
    calls = []
    real = type(peeler).term
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(peeler), "term", lambda self, *a: calls.append(a) or real(self, *a))
        assert peeler.peel(seqs) == []
    assert calls == []  # a refusal is final: no sentence's gradient is recomputed again


def test_no_peeling_where_the_update_is_not_an_exact_fedsgd_gradient(bert_cls):
    """Before any work: dropout (mode ``train``), a secure-aggregation sum, a frozen span weight (no
    gradient to recompute), a FedAvg delta, the noise-aware variants and ``peel = false`` get no peeler."""
    from gradleak.attacks.text.dager.spectral import DagerSpectral

    exact, _ = _observe(bert_cls, TEXTS, [1, 0])
    delta = dataclasses.replace(exact.update, kind="delta")
    frozen = copy.deepcopy(bert_cls.model)
    frozen.get_parameter("bert.encoder.layer.1.attention.self.query.weight").requires_grad_(False)
    cases = {
        "dropout": (Dager(), dataclasses.replace(exact, mode="train")),
        "aggregated": (Dager(), dataclasses.replace(exact, aggregated=True, num_clients=2)),
        "frozen": (Dager(), dataclasses.replace(exact, model=frozen)),
        "delta": (Dager(), dataclasses.replace(exact, update=delta)),
        "spectral": (DagerSpectral(), exact),
        "off": (Dager(DagerConfig(encoder=EncoderSearch(peel=False))), exact),
    }
    for name, (dager, obs) in cases.items():
        _, model, spec, _, search = _parts(bert_cls, obs, dager)
        assert dager.peeler(obs, model, spec, search) is None, name
    _, model, spec, _, search = _parts(bert_cls, exact)
    assert Dager().peeler(exact, model, spec, search) is not None


def test_the_attack_peels_and_recovers_the_batch_and_survives_an_empty_reread(bert_cls, monkeypatch):
    """End to end on the tiny BERT (three sentences, labels 1, 0, 1): the attack recovers the batch with
    two sentences peeled, and the same when the L1 re-read after a peel passes nothing (a stub: the
    search keeps its candidates instead of searching none)."""
    texts = (*TEXTS, "an honest film")
    obs, seqs = _observe(bert_cls, texts, [1, 0, 1])
    end = int(bert_cls.tokenizer.sep_token_id)
    config = DagerConfig(encoder=EncoderSearch(end_token_id=end))
    rec = Dager(config).reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(rec.token_ids) == sorted(seqs)
    assert rec.stats["peeled"] == 2
    real = Dager.peel_held

    def empty(self, *args):
        out = real(self, *args)
        return None if out is None else ([], out[1])

    monkeypatch.setattr(Dager, "peel_held", empty)
    again = Dager(config).reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(again.token_ids) == sorted(seqs)
    assert again.stats["peeled"] == rec.stats["peeled"]

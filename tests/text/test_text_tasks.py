"""The text tasks through the one client loop (gradleak.tasks.client.train_client), against the text stack's
own FedSGD/FedAvg implementations and obvious references (same batches, same seeds)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch.nn import functional as F

from gradleak.data.text import TextDataset, TokenDataset
from gradleak.metrics.utility import perplexity
from gradleak.tasks import CausalLM, TextClassification, task_from_spec, task_spec
from gradleak.tasks.client import train_client
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import LocalTraining

TEXTS = ("the movie was surprisingly good", "a dull and lifeless film .", "an honest , moving story",
         "nothing works here", "a fine cast wasted")  # fmt: skip


def tokens(tm, labels=(1, 0, 1, 0, 0)) -> TokenDataset:
    return TokenDataset.from_texts(
        TextDataset("t", TEXTS, labels, ("neg", "pos")), tm.tokenizer, max_tokens=12
    )


def test_token_dataset_batches_are_cut_to_their_longest_sequence(gpt2_lm):
    data = tokens(gpt2_lm)
    short = data.subset([1, 3])  # "a dull and lifeless film ." and "nothing works here"
    width = int(short.attention_mask.sum(1).max())
    assert short.batch().input_ids.shape == (2, width) < data.input_ids.shape
    assert short.batch().sequences() == [data.batch().sequences()[1], data.batch().sequences()[3]]
    both = TokenDataset.concat([short, data.subset([0])])
    assert both.batch().sequences() == [data.batch().sequences()[i] for i in (1, 3, 0)]
    assert both.pad_id == gpt2_lm.tokenizer.eos_token_id


@pytest.mark.parametrize(("fixture", "task", "name"), [
    ("gpt2_lm", CausalLM(), "causal_lm"), ("gpt2_cls", TextClassification(), "classification"),
    ("bert_cls", TextClassification(), "classification"),
])  # fmt: skip
def test_fedsgd_gradient_equals_the_text_clients(request, fixture, task, name):
    tm = request.getfixturevalue(fixture)
    data = tokens(tm)
    gen = torch.Generator().manual_seed(3)
    result = train_client(0, tm.model, data, LocalTraining("fedsgd", batch_size=3), [], gen, task=task)
    assert result.update is not None and result.update.metadata["mode"] == "eval"
    batch = data.subset(list(result.sample_index)).batch()
    want = fedsgd_text_update(tm.model, batch, name)
    for n, g in want.tensors.items():
        torch.testing.assert_close(result.update.tensors[n], g, rtol=1e-5, atol=1e-7)
    assert result.truth.batch().sequences() == batch.sequences()


def test_fedavg_adamw_delta_equals_a_plain_loop(gpt2_lm):
    """Two epochs of AdamW (weight decay 0.01) in batches of 2 against torch's AdamW on the same batches,
    with the loss computed by hand (next-token cross-entropy over the real tokens)."""
    data = tokens(gpt2_lm)
    training = LocalTraining("fedavg", epochs=2, batch_size=2, lr=1e-3, optimizer="adamw", weight_decay=0.01,
                             shuffle=False)  # fmt: skip
    result = train_client(
        0, gpt2_lm.model, data, training, [], torch.Generator().manual_seed(0), task=CausalLM()
    )
    model = copy.deepcopy(gpt2_lm.model).eval()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(2):
        for start in range(0, len(data), 2):
            b = data.subset(range(start, min(start + 2, len(data)))).batch()
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
            keep = b.attention_mask[:, 1:].bool()
            loss = F.cross_entropy(logits[keep], b.input_ids[:, 1:][keep])
            opt.zero_grad()
            loss.backward()
            opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(result.update.tensors[n], p.detach() - w0[n], rtol=1e-4, atol=1e-6)


def test_causal_lm_metrics_equal_a_token_by_token_reference(gpt2_lm):
    data = tokens(gpt2_lm)
    got = CausalLM().evaluate(gpt2_lm.model, data)
    assert got["perplexity"] == pytest.approx(perplexity(gpt2_lm.model, [data.batch()]), rel=1e-5)
    nll, hits, count = 0.0, 0, 0
    with torch.no_grad():
        for seq in data.batch().sequences():
            logits = gpt2_lm.model(input_ids=torch.tensor([seq])).logits[0]
            for t in range(len(seq) - 1):
                nll -= float(torch.log_softmax(logits[t], -1)[seq[t + 1]])
                hits += int(int(logits[t].argmax()) == seq[t + 1])
                count += 1
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert got["accuracy"] == pytest.approx(hits / count)


def test_text_classification_accuracy_counts_correct_labels(bert_cls):
    data = tokens(bert_cls)
    with torch.no_grad():
        pred = [
            int(bert_cls.model(input_ids=torch.tensor([s])).logits.argmax()) for s in data.batch().sequences()
        ]
    want = sum(p == y for p, y in zip(pred, data.labels.tolist(), strict=True)) / len(data)
    assert TextClassification().evaluate(bert_cls.model, data)["accuracy"] == pytest.approx(want)


def test_tasks_travel_as_json_and_refuse_the_wrong_data(gpt2_lm):
    for task in (CausalLM(), TextClassification(mode="train")):
        assert task_from_spec(json.loads(json.dumps(task_spec(task)))) == task
    with pytest.raises(ValueError, match="mode"):
        CausalLM(mode="inference")
    with pytest.raises(TypeError, match="TokenDataset"):
        CausalLM().loss(gpt2_lm.model, tokens(gpt2_lm).batch())

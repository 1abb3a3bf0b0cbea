"""GRAB as read here (issue 53): embedding matching that learns the client's dropout masks, alternating with
an exhaustive search of single-token moves, on the 2-layer random BERT with the real vocabulary.

The client computes its gradient with dropout on (p = 0.1 on the embeddings', attention outputs',
feed-forward outputs' and classifier's dropout; the attention probabilities' off, which GRAB does not
model here). With the client's own masks in the attacker's copy the objective vanishes at the true
embeddings; GRAB recovers the sentence exactly; from a null update none of its words. On an eval-mode
update no mask is installed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.attacks.text.grab import Grab, GrabConfig
from gradleak.data.text import TextBatch
from gradleak.models import build_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation


@pytest.fixture(scope="module")
def dropout_case():
    """The sentence's gradient under dropout, and the masks the client drew (read off by hooks)."""
    tm = build_model("bert_tiny", (16,), 2, seed=0)
    for name, m in tm.model.named_modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0 if "attention.self" in name else 0.1
    enc = tm.tokenizer(["the film was great fun"], return_tensors="pt")
    batch = TextBatch(enc["input_ids"], enc["attention_mask"], torch.tensor([1]))
    drawn: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(_m, args, out):
            x = args[0]
            ratio = out / torch.where(x != 0, x, torch.ones_like(x))
            drawn[name] = torch.where(x != 0, ratio, torch.ones_like(x)).detach()

        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in tm.model.named_modules()
               if isinstance(m, nn.Dropout) and m.p > 0]  # fmt: skip
    torch.manual_seed(0)
    update = fedsgd_text_update(tm.model, batch, "classification", dropout=True)
    for h in handles:
        h.remove()
    obs = Observation(tm.model, update, (7,), 2, labels=batch.labels)
    return tm, obs, enc["input_ids"][0].tolist(), drawn


def test_with_the_clients_masks_the_objective_vanishes_at_the_truth(dropout_case):
    """At the true embeddings: float rounding with the masks the client drew (-6.6e-8 measured), 0.145 with
    every mask at its expectation 1 (the copy GRAB starts from)."""
    tm, obs, true, drawn = dropout_case
    grab = Grab(GrabConfig())
    problem, table, _, _, _ = grab.problem(obs)
    assert obs.mode == "train" and grab.masks is not None and set(grab.masks.logits) == set(drawn)
    x = table[torch.tensor([true])]
    expected = float(problem.objective(x.clone().requires_grad_(True), create_graph=False))
    grab.masks.set(drawn)
    assert abs(float(problem.objective(x.clone().requires_grad_(True), create_graph=False))) < 1e-5
    assert expected > 0.05


def test_grab_recovers_a_sentence_and_the_classifiers_dropout_mask(dropout_case):
    """Seeds 0 and 1 by hand: the sentence exact both; LAMP at the same budget, whose copy draws fresh
    masks each forward, gave "[CLS] [CLS] film was great fun [SEP]" and "[CLS] [CLS] film was great [SEP]
    film". The learned classifier mask's mean error to the client's falls from 0.196 (all 1) to 0.052
    (both seeds); the inner masks are not identified (0.17-0.28 after, 0.19-0.25 before)."""
    tm, obs, true, drawn = dropout_case
    grab = Grab(GrabConfig(steps=300, init_candidates=50))
    rec = grab.reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert rec.token_ids == [true], tm.tokenizer.convert_ids_to_tokens(rec.token_ids[0])
    assert rec.stats["dropout_masks"] == 6 and grab.masks is not None
    before = float((1 - drawn["dropout"]).abs().mean())
    after = float((grab.masks.mask("dropout").detach() - drawn["dropout"]).abs().mean())
    assert before > 0.15 and after < 0.1, (before, after)


def test_a_null_update_gives_none_of_the_words(dropout_case):
    _, obs, true, _ = dropout_case
    null = null_observation(obs, torch.Generator().manual_seed(1))
    rec = create_attack("grab", steps=100, init_candidates=5).reconstruct(
        null, generator=torch.Generator().manual_seed(0)
    )
    assert not set(true[1:-1]) & set(rec.token_ids[0])


def test_an_eval_mode_update_gets_no_masks_and_the_moves_are_every_single_token_move():
    tm = build_model("bert_tiny", (16,), 2, seed=0)
    enc = tm.tokenizer(["the film was great fun"], return_tensors="pt")
    batch = TextBatch(enc["input_ids"], enc["attention_mask"], torch.tensor([1]))
    obs = Observation(
        tm.model, fedsgd_text_update(tm.model, batch, "classification"), (7,), 2, labels=batch.labels
    )
    rec = create_attack("grab", steps=300, init_candidates=50).reconstruct(
        obs, generator=torch.Generator().manual_seed(0)
    )
    assert rec.token_ids == [enc["input_ids"][0].tolist()] and rec.stats["dropout_masks"] == 0
    perms = Grab()._moves(4, torch.Generator())
    assert len(perms) == 1 + 4 * 3 - 3 and len({tuple(p.tolist()) for p in perms}) == len(
        perms
    )  # 3 swaps twice

"""Peeling recovered sentences off a FedSGD gradient (DAGER's encoder rounds).

A FedSGD update of a classifier is the batch's mean gradient (1 / B) sum_s grad l(s, y_s), and each
sentence's term depends on that sentence alone (padding is masked out of the attention). Once a sentence
is held exactly (it passed DAGER's block-2 check), the attacker recomputes its term at the broadcast
weights and subtracts it. What is left is the gradient of the sentences still missing, so the attention
projections' input spans shrink to their tokens: block 2's rank falls by exactly the held sentence's
length. This is what makes it checkable. The label is not needed in advance: of the classes, the one
whose term makes the rank fall so is the sentence's (a wrong one leaves a rank-len(s) remainder; 69
against 50 on a Rotten Tomatoes batch of 8 with six held). A term that makes no class fit (a defended,
clipped, aggregated-with-unknown-weights or dropout gradient) is not subtracted. Only block 2's span is
checked so; the others (block 1's, the feed-forward screen's) take the same term, and block 2's and the
screen's spans re-read from what is left are capped at the rank block 2's check predicts.

On all-MiniLM-L6-v2 this turns the L1 filter from useless to sharp. On the full update every batch token
passes it at nearly every position (a layer-1 input is nearly a word part plus a position part, and the
batch's words and positions span all their sums). With six of a WikiText-2 batch's eight sentences
peeled it passes 1-9 tokens a position, with seven exactly the missing sentence's token at each position
(docs/attacks-text.md, item 4). The search for the last sentences then no longer descends into the held
sentences' basins, where most of its time went.

Not in DAGER (Petrov et al., NeurIPS 2024): subtracting a known sample's gradient from a batch gradient
is the batch-disaggregation step of several image attacks, applied here to DAGER's spans.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.attacks.text.family import Layout, Span, estimate_span, input_side_matrix, update_tensor
from gradleak.types import Observation

log = logging.getLogger(__name__)


@dataclass
class Peeler:
    """The part of an exact FedSGD classifier gradient that the held sentences do not explain.

    ``layouts`` names each span's gradient matrix (``"l2"``, block 2's attention inputs, decides which
    sentences are peeled; the others follow). ``scale`` is each sentence's weight in the update (1 / B for
    the batch's mean loss); ``classes`` the labels tried per sentence; ``rank`` block 2's rank of what is
    left (one per position of the sentences not peeled).
    """

    model: nn.Module
    layouts: Mapping[str, Layout]
    rest: dict[str, torch.Tensor]  # (d_in, k) per span, float64
    scale: float
    classes: int
    rank_tol: float
    rank: int
    peeled: list[list[int]] = field(default_factory=list)
    refused: list[list[int]] = field(default_factory=list)

    @classmethod
    def build(
        cls, obs: Observation, model: nn.Module, layouts: Mapping[str, Layout], rank_tol: float
    ) -> Peeler:
        """The peeler of ``obs``'s update (a FedSGD gradient of a classifier; the caller checks that)."""
        rest = {
            key: input_side_matrix({n: update_tensor(obs, n) for n, _ in lay}, lay)
            for key, lay in layouts.items()
        }
        classes = int(getattr(getattr(model, "config", None), "num_labels", 0) or obs.num_classes)
        rank = estimate_span(rest["l2"], rank_tol).rank
        return cls(model, layouts, rest, 1.0 / max(1, obs.update.num_samples), classes, rank_tol, rank)

    def span(self, key: str) -> Span:
        """The span of ``key``'s inputs in what is left of the update, at most :attr:`rank` wide for block
        2's and the feed-forward screen's (both count the positions of the sentences not peeled)."""
        return estimate_span(self.rest[key], self.rank_tol, max_rank=None if key == "l1" else self.rank)

    def peel(self, held: Sequence[list[int]]) -> list[list[int]]:
        """Subtract each held sentence not peeled (or refused) yet whose term, under some class, lowers
        block 2's rank by exactly its length; returns the sentences peeled now. A refusal is final: it does
        not depend on the other sentences (their terms are exact or not there)."""
        now = []
        for seq in held:
            if seq in self.peeled or seq in self.refused:
                continue
            for label in range(self.classes):
                term = self.term(seq, label)
                if estimate_span(self.rest["l2"] - term["l2"], self.rank_tol).rank == self.rank - len(seq):
                    self.rest = {key: self.rest[key] - term[key] for key in self.rest}
                    self.rank -= len(seq)
                    self.peeled.append(list(seq))
                    now.append(list(seq))
                    log.debug("peeled a sentence of %d tokens (class %d)", len(seq), label)
                    break
            else:
                self.refused.append(list(seq))
                log.info("DAGER: a held sentence of %d tokens does not peel (no class fits)", len(seq))
        return now

    def term(self, seq: list[int], label: int) -> dict[str, torch.Tensor]:
        """``scale`` times one sentence's gradient (its cross-entropy at ``label``) per span matrix."""
        params = dict(self.model.named_parameters())
        names = sorted({n for lay in self.layouts.values() for n, _ in lay})
        with torch.enable_grad():
            loss = self.model(input_ids=torch.tensor([seq]), labels=torch.tensor([label])).loss
            grads = torch.autograd.grad(loss, [params[n] for n in names])
        by_name = {n: g.detach().to(torch.float64) * self.scale for n, g in zip(names, grads, strict=True)}
        return {key: input_side_matrix(by_name, lay) for key, lay in self.layouts.items()}

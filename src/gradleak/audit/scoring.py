"""How a reconstruction is scored against the truth, with its no-information floor: one scorer per modality.

- images (:class:`ImageScorer`): PSNR, SSIM, FSIM, reconstruction rate and label accuracy of the optimally
  matched images; floors from random same-class and class-mean public images
  (:mod:`gradleak.metrics.floors`), and the leakage above the higher one;
- text (:class:`TextScorer`): ROUGE-1/2/L, METEOR and the exact-sequence rate of the matched sequences (or
  of the recovered token set, for an attack that returns one); floor: the same attack on a norm-matched
  random update (paper 002's null, Sec. VI-C), and paper 002's validity gate.

Ground truth meets a reconstruction only here. The in-process runner, the Flower engine and the Flower
wrappers score through the same scorer (:mod:`gradleak.audit.pipeline`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gradleak.attacks.text.baseline import is_valid, null_observation
from gradleak.data.base import ImageDataset
from gradleak.data.text import TokenDataset
from gradleak.metrics import score_images
from gradleak.metrics.floors import beyond_floor, null_floors
from gradleak.metrics.text import decode, score_texts, score_token_set
from gradleak.types import Attack, AttackInputError, Observation, Reconstruction

SHOWN_TEXTS = 16  # reconstructed and true texts kept in a record (for the report)
TEXT_SCORES = ("rouge1", "rouge2", "rougeL", "meteor", "exact")


class Scorer(Protocol):
    """Scores a reconstruction against the data behind the update, and measures its floor."""

    def score(self, rec: Reconstruction, truth: Any) -> dict[str, Any]: ...

    def floors(
        self, attack: Attack, obs: Observation, truth: Any, scores: dict[str, Any], generator: torch.Generator
    ) -> dict[str, Any]: ...


def label_accuracy(recovered: torch.Tensor | None, truth: torch.Tensor | None) -> float | None:
    """Fraction of true labels recovered, as multisets (order-free); None when either is missing."""
    if recovered is None or truth is None:
        return None
    hit = Counter(recovered.tolist()) & Counter(truth.tolist())
    return sum(hit.values()) / max(1, len(truth))


def score_reconstruction(rec: Reconstruction, truth: ImageDataset) -> dict[str, Any]:
    """Label accuracy and (for images) every image score of ``rec`` against the true ``truth``."""
    out: dict[str, Any] = {"label_accuracy": label_accuracy(rec.labels, truth.labels)}
    if rec.images is not None:
        out.update(score_images(rec.images, truth.images).to_dict())
    return out


@dataclass(frozen=True)
class ImageScorer:
    """Image scores; floors from the server's ``public`` images (none without them)."""

    public: ImageDataset | None = None

    def score(self, rec: Reconstruction, truth: ImageDataset) -> dict[str, Any]:
        return score_reconstruction(rec, truth)

    def floors(
        self, attack: Attack, obs: Observation, truth: ImageDataset, scores: dict[str, Any],
        generator: torch.Generator,
    ) -> dict[str, Any]:  # fmt: skip
        """Random same-class and class-mean public images scored like a reconstruction, and the leakage
        above the higher floor."""
        if "psnr_mean" not in scores or self.public is None:
            return {}
        out = null_floors(truth, self.public, generator)
        return {**out, **beyond_floor({**scores, **out})}


def token_overlap(found: Sequence[Sequence[int]], refs: Sequence[Sequence[int]]) -> dict[str, float]:
    """Order-blind: the share of the batch's distinct token ids that the reconstruction holds
    (``token_recall``) and of the reconstruction's distinct ids that the batch holds (``token_precision``);
    what a token-set attack reads, which its set ROUGE-1 understates (repeated words, one decoding)."""
    got, true = {t for seq in found for t in seq}, {t for seq in refs for t in seq}
    hit = len(got & true)
    return {
        "token_recall": hit / len(true) if true else 0.0,
        "token_precision": hit / len(got) if got else 0.0,
    }


@dataclass(frozen=True)
class TextScorer:
    """Text scores of token sequences decoded with ``tokenizer``; the null-update floor."""

    tokenizer: Any

    def score(self, rec: Reconstruction, truth: TokenDataset) -> dict[str, Any]:
        """ROUGE/METEOR/exact of the matched sequences (an unordered token set: against the batch's
        tokens), label accuracy, and the first reconstructed and true texts."""
        refs = truth.batch().sequences()
        found = rec.token_ids or []
        hyps, true = decode(self.tokenizer, found), decode(self.tokenizer, refs)
        if rec.ordered:
            scores = score_texts(hyps, true)
            matched = [""] * len(true)  # each true sequence's matched reconstruction
            for i, j in scores.pairs:
                matched[j] = hyps[i]
        else:
            scores = score_token_set([t for seq in found for t in seq], refs, self.tokenizer)
            matched = []
        return {**scores.as_dict(), **token_overlap(found, refs),
                "label_accuracy": label_accuracy(rec.labels, truth.labels),
                "recovered_sequences": len(found), "texts": hyps[:SHOWN_TEXTS],
                "true_texts": true[:SHOWN_TEXTS], "matched_texts": matched[:SHOWN_TEXTS]}  # fmt: skip

    def floors(
        self, attack: Attack, obs: Observation, truth: TokenDataset, scores: dict[str, Any],
        generator: torch.Generator,
    ) -> dict[str, Any]:  # fmt: skip
        """The attack on a norm-matched random update in place of the client's (paper 002's null),
        scored the same way: ``floor_null_<score>``, ``<score>_beyond_floor`` and the validity gate."""
        null_gen = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
        null = null_observation(obs, generator)
        try:
            rec = attack.reconstruct(null, generator=null_gen)
        except AttackInputError:  # the attack finds nothing to read in noise: it recovers nothing
            rec = Reconstruction(token_ids=[])
        floor = self.score(rec, truth)
        out: dict[str, Any] = {f"floor_null_{k}": floor[k] for k in TEXT_SCORES}
        for k in TEXT_SCORES:
            if isinstance(scores.get(k), int | float) and isinstance(floor[k], int | float):
                out[f"{k}_beyond_floor"] = float(scores[k]) - float(floor[k])
        out["valid"] = is_valid(float(scores.get("rouge1") or 0.0), float(floor["rouge1"]))
        return out

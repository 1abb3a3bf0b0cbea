"""Text reconstruction and utility metrics (paper 002, Sec. VI-A "Metrics").

* ROUGE-1/2/L F-measures (Lin 2004) with the ``rouge-score`` package (its default tokenizer: lower case,
  alphanumeric tokens, no stemming), and METEOR (Banerjee & Lavie 2005) with NLTK over whitespace tokens,
  WordNet prepared offline by :mod:`gradleak.data.wordnet`.
* One-to-one matching of reconstructed to reference sequences: the assignment maximising total ROUGE-1
  (``scipy.optimize.linear_sum_assignment``); each reference's scores come from its matched reconstruction
  (0 when there are fewer reconstructions than references), averaged over references as in DAGER.
* ``exact``: the share of references reconstructed character for character (after whitespace strip).
* Utility: perplexity exp(mean token NLL), accuracy and macro F1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from scipy.optimize import linear_sum_assignment

from gradleak.data.wordnet import ensure_wordnet

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


@lru_cache(maxsize=1)
def _scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=False)


def rouge(hypothesis: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures of one hypothesis against one reference."""
    scores = _scorer().score(reference, hypothesis)
    return {k: float(scores[k].fmeasure) for k in ROUGE_KEYS}


def meteor(hypothesis: str, reference: str) -> float:
    """NLTK METEOR over whitespace tokens (alpha 0.9, beta 3, gamma 0.5); raises if WordNet is absent."""
    ensure_wordnet()
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([reference.split()], hypothesis.split()))


def match(hypotheses: Sequence[str], references: Sequence[str]) -> list[tuple[int, int]]:
    """(hypothesis, reference) index pairs maximising the summed ROUGE-1 F, one to one."""
    if not hypotheses or not references:
        return []
    gain = np.array([[rouge(h, r)["rouge1"] for r in references] for h in hypotheses])
    rows, cols = linear_sum_assignment(gain, maximize=True)
    return [(int(i), int(j)) for i, j in zip(rows, cols, strict=True)]


@dataclass
class TextScores:
    rouge1: float
    rouge2: float
    rougeL: float
    meteor: float | None
    exact: float
    pairs: list[tuple[int, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, float | None]:
        return {"rouge1": self.rouge1, "rouge2": self.rouge2, "rougeL": self.rougeL,
                "meteor": self.meteor, "exact": self.exact}  # fmt: skip


def score_texts(
    hypotheses: Sequence[str], references: Sequence[str], *, with_meteor: bool = True
) -> TextScores:
    """Matched ROUGE/METEOR/exact rate, averaged over the references (module docstring)."""
    if not references:
        raise ValueError("no reference sequences to score against")
    pairs = match(hypotheses, references)
    per = {k: [0.0] * len(references) for k in (*ROUGE_KEYS, "meteor", "exact")}
    for i, j in pairs:
        for k, v in rouge(hypotheses[i], references[j]).items():
            per[k][j] = v
        if with_meteor:
            per["meteor"][j] = meteor(hypotheses[i], references[j])
        per["exact"][j] = float(hypotheses[i].strip() == references[j].strip())
    mean = {k: sum(v) / len(references) for k, v in per.items()}
    return TextScores(
        mean["rouge1"], mean["rouge2"], mean["rougeL"], mean["meteor"] if with_meteor else None,
        mean["exact"], pairs,
    )  # fmt: skip


def score_token_set(
    recovered: Iterable[int], references: Sequence[Sequence[int]], tokenizer: Any
) -> TextScores:
    """Score an unordered token set (side-channel attacks) against the batch's concatenated references.

    The recovered tokens are decoded one by one (id order), joined by spaces and compared with all
    references joined, so ROUGE-1 measures token overlap; ROUGE-2/L and METEOR are reported but
    order-blind attacks score low on them by construction.
    """
    hyp = " ".join(t for t in decode(tokenizer, [[v] for v in sorted(set(recovered))]) if t)
    ref = " ".join(decode(tokenizer, references))
    return score_texts([hyp], [ref])


def decode(tokenizer: Any, sequences: Sequence[Sequence[int]]) -> list[str]:
    """Token id sequences to text, special tokens dropped."""
    return [tokenizer.decode(list(s), skip_special_tokens=True).strip() for s in sequences]

"""The privacy scores an audit reports, per data modality: record key, column header, one-line meaning.

One place for the terminal table (``gradleak run``), the grid summary and the HTML report. The headline
column of each modality is the leakage above its no-information floor, measured in the same run
(:mod:`gradleak.experiments.setup`); the raw score and the floor stand beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradleak.registry import DATASETS


@dataclass(frozen=True)
class Column:
    key: str  # in the attack records
    header: str
    meaning: str


IMAGE = (
    Column("psnr_mean_beyond_floor", "PSNR over floor", "headline leakage: the reconstructions' mean PSNR "
           "minus the higher null floor, dB (> 0: the attack learned something from the update)"),
    Column("reconstruction_rate_beyond_floor", "RR over floor",
           "share of images reconstructed above 18 dB, minus the same share for the higher floor"),
    Column("psnr_mean", "PSNR dB", "mean PSNR of the optimally matched reconstructions (100 dB = identical)"),
    Column("ssim_mean", "SSIM", "structural similarity of the matched reconstructions (1 = identical)"),
    Column("reconstruction_rate", "RR", "reconstruction rate: share of the client's images above 18 dB"),
    Column("floor_class_mean_psnr_mean", "floor: class mean dB",
           "PSNR of each image's public class-mean image, scored like a reconstruction (needs no update)"),
    Column("floor_random_psnr_mean", "floor: random dB",
           "PSNR of a random public image of each image's class, scored like a reconstruction"),
    Column("label_accuracy", "label acc", "share of the true labels the attack recovered"),
)  # fmt: skip

TEXT = (
    Column("rouge1_beyond_floor", "R-1 over null", "headline leakage: ROUGE-1 of the reconstructions minus "
           "the same attack's ROUGE-1 on a norm-matched random update (> 0: it read the client's text)"),
    Column("rouge1", "ROUGE-1", "unigram F1 of the one-to-one matched reconstructed and true sequences (a "
           "token-set attack: of its tokens against the batch's)"),
    Column("rouge2", "ROUGE-2", "bigram F1 of the matched sequences (order-blind token sets score low)"),
    Column("meteor", "METEOR", "METEOR of the matched sequences (WordNet synonyms and stems)"),
    Column("exact", "exact seq.", "share of the true sequences recovered exactly"),
    Column("token_recall", "token recall", "share of the batch's distinct tokens the reconstruction holds, "
           "in any order (a token-set attack's reading, which its set ROUGE-1 understates)"),
    Column("token_precision", "token prec.", "share of the reconstruction's distinct tokens that are in the "
           "batch (0 where it recovered none)"),
    Column("floor_null_rouge1", "null R-1", "the attack's ROUGE-1 on a norm-matched random update (paper "
           "002's null; an attack counts when its ROUGE-1 exceeds 0.10 and the null by 0.05)"),
    Column("label_accuracy", "label acc", "share of the true labels the attack recovered"),
)  # fmt: skip

# the formal guarantee a defense states for the update it formed (gradleak.defenses.base.claims)
GUARANTEE = Column("epsilon", "epsilon", "the (epsilon, delta)-DP the update's defense states for it, at "
                   "the delta of its config (dp_sgd: Opacus' accountant for this round's steps; "
                   "update_noise: the Gaussian mechanism); blank: no formal claim")  # fmt: skip

PRIVACY: Mapping[str, tuple[Column, ...]] = {"image": (*IMAGE, GUARANTEE), "text": (*TEXT, GUARANTEE)}

NOTES = {
    "image": "Reconstruction rate = share of images with PSNR > 18 dB; 'over floor' = the score minus the "
    "higher of two no-information floors scored the same way (each image's public class mean; a random "
    "public image of its class); LPIPS unavailable offline.",
    "text": "ROUGE/METEOR of the one-to-one matched sequences; 'over null' = the score minus the same "
    "attack's score on a norm-matched random update in place of the client's (paper 002's null).",
}


def keys() -> tuple[str, ...]:
    """Every privacy key of every modality, once (what a grid summarises)."""
    seen: dict[str, None] = {}
    for columns in PRIVACY.values():
        seen.update((c.key, None) for c in columns)
    return tuple(seen)


def modality_of(dataset: str) -> str:
    """The modality of a data set by name (``"image"`` for one not registered here, e.g. a plugin's that
    is not loaded while reading a store)."""
    return (DATASETS.entry(dataset).modality if dataset in DATASETS else None) or "image"


UTILITY = (
    Column("final_accuracy", "test acc", "the global model's test accuracy after the rounds (a causal LM: "
           "next-token top-1 accuracy)"),
    Column("final_perplexity", "test ppl", "a causal LM's test perplexity after the rounds (lower = better)"),
)  # fmt: skip


def withheld(records: Sequence[Mapping[str, object]], cell: int) -> int:
    """Audited clients whose update never reached attack ``cell`` (``client_error`` records)."""
    return sum(1 for r in records if r.get("kind") == "client_error" and r.get("cell") == cell)


def failed(records: Sequence[Mapping[str, object]], cell: int) -> int:
    """Updates attack ``cell`` failed on (its ``attack_error`` records)."""
    return sum(1 for r in records if r.get("kind") == "attack_error" and r.get("cell") == cell)


def updates_label(row: Mapping[str, Any]) -> str:
    """A row's ``updates`` cell: the attacked updates, the audited clients that sent none, and the updates
    the attack failed on."""
    counts = ((row.get("withheld", 0), "withheld"), (row.get("failed", 0), "failed"))
    notes = [f"{n} {what}" for n, what in counts if n]
    return f"{row['updates']} ({', '.join(notes)})" if notes else str(row["updates"])

"""The one audit pipeline: attack an observed update, score it beside its floor, make its record.

:mod:`gradleak.audit.scoring` scores a reconstruction against the truth per modality (with the floor a
no-information guess reaches); :mod:`gradleak.audit.pipeline` runs one attack on one observation with one
failure policy and one seed rule. The in-process runner and the Flower wrappers observe and commit in
their own ways and share this middle.
"""

from gradleak.audit.pipeline import AttackOutcome, attack_update, audit_generators
from gradleak.audit.scoring import ImageScorer, Scorer, TextScorer, label_accuracy, score_reconstruction

__all__ = [
    "AttackOutcome",
    "ImageScorer",
    "Scorer",
    "TextScorer",
    "attack_update",
    "audit_generators",
    "label_accuracy",
    "score_reconstruction",
]

"""LM-head row-norm probe (paper 002, Sec. VI-C, adaptive side-channel stress test; untied heads).

An untied head's gradient dL/dW_LM = (1/N) sum_t (p_t - e_{y_t}) h_t^T has its large rows at the target
tokens y_t (every token but each sequence's first). Tied heads share the embedding's gradient tensor and
are covered by ``embedding_norm``. Selection: :mod:`rownorm`.
"""

from __future__ import annotations

from gradleak.attacks.text.family import embedding_param
from gradleak.attacks.text.lm_completion import lm_head_param
from gradleak.attacks.text.rownorm import NoisyRowNormAttack, NoisyRowNormConfig, RowNormAttack, RowNormConfig
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation


class LMHeadProbe(RowNormAttack):
    """The target-token set from an untied LM head's gradient row norms."""

    channel = "lm_head"

    def param(self, obs: Observation) -> str:
        name = lm_head_param(obs.model)
        if name == embedding_param(obs.model):
            raise AttackInputError("the LM head is tied to the input embedding: use embedding_norm")
        return name


ATTACKS.register(
    "lm_head_probe",
    LMHeadProbe,
    config_cls=RowNormConfig,
    summary="target-token set from an untied LM head's gradient row norms (paper 002 Sec. VI-C)",
    modality="text",
)


class LMHeadNoise(NoisyRowNormAttack):
    """The target-token set from an untied head's rows above the noise edge. What it knows of the defense:
    every entry of the head gradient carries i.i.d. Gaussian noise (AEGIS floods an untied head as the
    embedding, DP), of a stated, configured or estimated scale (:mod:`gradleak.attacks.text.rownorm`)."""

    channel = "lm_head_noise"
    param = LMHeadProbe.param


ATTACKS.register(
    "lm_head_noise",
    LMHeadNoise,
    config_cls=NoisyRowNormConfig,
    summary="untied LM-head row norms above the noise edge, knowing the rows were flooded or noised (AEGIS, "
    "DP; adaptive)",
    modality="text",
)

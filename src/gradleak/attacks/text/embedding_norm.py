"""Channel 2 of paper 002 (Sec. III-C, Def. 2): the batch's token set from embedding-gradient row norms.

The input-embedding gradient is non-zero exactly on the rows of the tokens in the batch (the union over
its sequences); a tied LM head adds a dense but smaller term. Selection: :mod:`rownorm`.
"""

from __future__ import annotations

from gradleak.attacks.text.family import embedding_param
from gradleak.attacks.text.rownorm import NoisyRowNormAttack, NoisyRowNormConfig, RowNormAttack, RowNormConfig
from gradleak.registry import ATTACKS
from gradleak.types import Observation


class EmbeddingNorm(RowNormAttack):
    """The union token set from the input-embedding gradient's row norms."""

    channel = "embedding_norm"

    def param(self, obs: Observation) -> str:
        return embedding_param(obs.model)


ATTACKS.register(
    "embedding_norm",
    EmbeddingNorm,
    config_cls=RowNormConfig,
    summary="token set from embedding-gradient row norms (paper 002 Channel 2)",
    modality="text",
)


class EmbeddingNormNoise(NoisyRowNormAttack):
    """The batch's token set from the embedding rows above the noise edge. What it knows of the defense:
    every entry of the embedding gradient carries i.i.d. Gaussian noise (AEGIS's flood, DP), of a stated,
    configured or estimated scale (:mod:`gradleak.attacks.text.rownorm`)."""

    channel = "embedding_norm_noise"
    param = EmbeddingNorm.param


ATTACKS.register(
    "embedding_norm_noise",
    EmbeddingNormNoise,
    config_cls=NoisyRowNormConfig,
    summary="embedding row norms above the noise edge, knowing the rows were flooded or noised (AEGIS, DP; "
    "adaptive)",
    modality="text",
)

"""Defense settings shared by the AEGIS (paper 002) benchmarks: the ablation variants and the baselines.

* ``none``: undefended.
* ``freeze``: attention frozen only; ``embed``: embedding flood only (Channel 2); ``aegis_2ch``: freeze +
  embedding flood (the paper's AEGIS-dagger, Table II/V); ``aegis``: the full triple-channel defense with the
  paper's defaults; ``aegis_rho_fc_0.3``: the utility-preserving MLP retain ratio of the paper's Table V run.
* ``dp_<sigma>``: the batch gradient clipped to norm 1 plus N(0, sigma^2) per entry (``dp_noise`` with
  ``batch_size = 1``, so its std is sigma * clip); ``prune_<pct>``: magnitude pruning of the upload
  (``pruning``), as in paper 002's Figure 3/4 baselines.

Each factory returns fresh defense objects (defenses keep per-run state).
"""

from __future__ import annotations

from collections.abc import Callable

from gradleak.defenses import Defense
from gradleak.defenses.aegis_llm import AegisLLM, AegisLLMConfig
from gradleak.defenses.baselines import DPNoise, DPNoiseConfig
from gradleak.defenses.pruning import Pruning, PruningConfig

_OFF = {"flood_embedding": False, "flood_mlp": False, "flood_layernorm": False, "flood_lm_head": False,
        "flood_other_embeddings": False}  # fmt: skip


def _aegis(**kw: object) -> Callable[[], list[Defense]]:
    return lambda: [AegisLLM(AegisLLMConfig(**kw))]  # type: ignore[arg-type]


def _dp(sigma: float) -> Callable[[], list[Defense]]:
    return lambda: [DPNoise(DPNoiseConfig(clip=1.0, sigma=sigma, batch_size=1))]


def _prune(ratio: float) -> Callable[[], list[Defense]]:
    return lambda: [Pruning(PruningConfig(ratio))]


SETTINGS: dict[str, Callable[[], list[Defense]]] = {
    "none": lambda: [],
    "freeze": _aegis(**_OFF),
    "embed": _aegis(**{**_OFF, "freeze_attention": False, "flood_embedding": True}),
    "aegis_2ch": _aegis(flood_mlp=False),
    "aegis": _aegis(),
    "aegis_rho_fc_0.3": _aegis(rho_fc=0.3),
    "dp_0.001": _dp(0.001),
    "dp_0.01": _dp(0.01),
    "dp_0.1": _dp(0.1),
    "prune_50": _prune(0.5),
    "prune_90": _prune(0.9),
    "prune_99": _prune(0.99),
}
AEGIS_SETTINGS = ("freeze", "embed", "aegis_2ch", "aegis", "aegis_rho_fc_0.3")

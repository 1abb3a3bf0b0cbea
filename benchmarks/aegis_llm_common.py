"""Defense settings shared by the AEGIS (paper 002) benchmarks: the ablation variants and the baselines.

* ``none``: undefended.
* ``freeze``: attention frozen only; ``embed``: embedding flood only (Channel 2); ``aegis_2ch``: freeze +
  embedding flood (the paper's AEGIS-dagger, Table II/V); ``aegis``: the full triple-channel defense with the
  paper's defaults; ``aegis_rho_fc_0.3``: the utility-preserving MLP retain ratio of the paper's Table V run;
  ``aegis_fc_<lambda>``: ``rho_fc = 0.3`` with a smaller MLP flood scale (our sweep, not the paper's).
* ``dp_<sigma>``: the batch gradient clipped to norm 1 plus N(0, sigma^2) per entry (``dp_noise`` with
  ``batch_size = 1``, so its std is sigma * clip); ``prune_<pct>``: magnitude pruning of the upload
  (``pruning``); ``soteria``: Sun et al.'s representation pruning (80 % of the features, 8 JVP probes) on
  the input of the output layer (LM head or classifier), with the token-embedding output as the perturbed
  input: paper 002's Figure 3/4 baselines.

Each factory takes the model (Soteria needs its layer names) and returns fresh defense objects (defenses keep
per-run state).
"""

from __future__ import annotations

from collections.abc import Callable

from gradleak.attacks.text.family import find_module
from gradleak.defenses import Defense
from gradleak.defenses.aegis_llm import AegisLLM, AegisLLMConfig
from gradleak.defenses.baselines import DPNoise, DPNoiseConfig, Soteria, SoteriaConfig
from gradleak.defenses.pruning import Pruning, PruningConfig
from gradleak.text.data import TextBatch, TextDataset, encode
from gradleak.text.families import FAMILIES
from gradleak.text.models import TextModel

_OFF = {"flood_embedding": False, "flood_mlp": False, "flood_layernorm": False, "flood_lm_head": False,
        "flood_other_embeddings": False}  # fmt: skip


Factory = Callable[[TextModel], list[Defense]]


def encode_batches(data: TextDataset, size: int, tm: TextModel, max_tokens: int) -> list[TextBatch]:
    """``data`` in order, cut into consecutive batches of ``size`` sequences (labels kept when present)."""
    out = []
    for i in range(0, len(data), size):
        part = data.subset(range(i, min(i + size, len(data))))
        labels = list(part.labels) if part.labels is not None else None
        out.append(encode(list(part.texts), tm.tokenizer, max_tokens=max_tokens, labels=labels))
    return out


def _aegis(**kw: object) -> Factory:
    return lambda tm: [AegisLLM(AegisLLMConfig(**kw))]  # type: ignore[arg-type]


def _dp(sigma: float) -> Factory:
    return lambda tm: [DPNoise(DPNoiseConfig(clip=1.0, sigma=sigma, batch_size=1))]


def _prune(ratio: float) -> Factory:
    return lambda tm: [Pruning(PruningConfig(ratio))]


def _soteria(tm: TextModel) -> list[Defense]:
    """Soteria on the task's output head (its input is the representation), the family map's layers."""
    family = FAMILIES.get(tm.family)
    consumer, (source, _) = family.heads[tm.task], find_module(tm.model, family.embedding)
    return [Soteria(SoteriaConfig(consumer=consumer, input_module=source, percent=80.0, probes=8))]


SETTINGS: dict[str, Factory] = {
    "none": lambda tm: [],
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
    "soteria": _soteria,
    # MLP flood-scale sweep at the utility-preserving retain ratio (not in the paper; a trade-off probe)
    "aegis_fc_0.25": _aegis(lam_fc=0.25, rho_fc=0.3),
    "aegis_fc_1": _aegis(lam_fc=1.0, rho_fc=0.3),
    "aegis_fc_2": _aegis(lam_fc=2.0, rho_fc=0.3),
}
AEGIS_SETTINGS = ("freeze", "embed", "aegis_2ch", "aegis", "aegis_rho_fc_0.3", "aegis_fc_0.25", "aegis_fc_1",
                  "aegis_fc_2")  # fmt: skip

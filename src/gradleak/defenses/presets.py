"""Named defense presets: a defense at the settings a paper or a table names, usable wherever a config
names a defense (``defenses = ["aegis_2ch"]``, ``[grid] defenses = ["none", "dp_sgd_eps8", "prune_90"]``).

A preset is a registered defense plus options; the grid labels its cell with the preset's name, and options
given beside the name override the preset's (``{ name = "prune_90", ratio = 0.5 }``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gradleak.registry import DEFENSES, PRESETS
from gradleak.spec import ComponentSpec, as_spec


@dataclass(frozen=True)
class Preset:
    defense: str
    options: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""


_NO_FLOODS = {"flood_embedding": False, "flood_mlp": False, "flood_layernorm": False, "flood_lm_head": False,
              "flood_other_embeddings": False}  # fmt: skip

_PRESETS: dict[str, Preset] = {
    "aegis_freeze": Preset(
        "aegis_llm", _NO_FLOODS, "AEGIS Channel 1 alone: attention frozen, no flood (paper 002 Table II)"
    ),
    "aegis_embed": Preset(
        "aegis_llm", {**_NO_FLOODS, "freeze_attention": False, "flood_embedding": True},
        "AEGIS Channel 2 alone: the embedding flood, attention trained (paper 002 Table II)",
    ),
    "aegis_2ch": Preset(
        "aegis_llm", {"flood_mlp": False},
        "AEGIS-dagger (paper 002): attention frozen + embedding flood, the MLP channel open",
    ),
    "aegis_rho_fc_0.3": Preset(
        "aegis_llm", {"rho_fc": 0.3}, "AEGIS with the MLP retain ratio of paper 002's Table V"
    ),
    "aegis_light": Preset(
        "aegis_llm", {"rho_fc": 1.0, "lam_fc": 0.3},
        "AEGIS with the MLP gradient kept whole under a flood of scale 0.3: mlp_spectral reads nothing "
        "correct (SNR <= 1.6 on GPT-2 small and MiniLM; aegis_mlp_channel.toml) at 2.2 accuracy points on "
        "MiniLM, AEGIS 9.8 (aegis_mlp_utility.toml); the margin depends on the model",
    ),
    **{
        f"batch_noise_{s:g}": Preset(
            "batch_noise", {"clip": 1.0, "sigma": s, "batch_size": 1},
            f"the batch gradient clipped to norm 1 plus N(0, {s:g}^2) per entry, no epsilon "
            f"(paper 002 Figs. 3/4 call it DP {s:g})",
        )
        for s in (0.001, 0.01, 0.1)
    },
    **{
        f"dp_sgd_eps{e:g}": Preset(
            "dp_sgd", {"clip": 1.0, "target_epsilon": e, "budget_steps": 1, "delta": 1e-5},
            f"DP-SGD (Opacus): per-sample clip 1, sigma for epsilon {e:g} at delta 1e-5 over one step (a "
            "FedSGD round; set budget_steps for more)",
        )
        for e in (1.0, 8.0)
    },
    "dp_sgd_clip": Preset(
        "dp_sgd", {"clip": 1.0, "noise_multiplier": 0.0},
        "DP-SGD's per-sample clipping to 1 without noise (epsilon infinite): what clipping alone does",
    ),
    "update_dp_eps0.5": Preset(
        "update_noise", {"clip": 1.0, "epsilon": 0.5, "delta": 1e-5},
        "the whole update clipped to 1, Gaussian noise for epsilon 0.5 at delta 1e-5 (Flower's LocalDpMod)",
    ),
    **{
        f"prune_{p}": Preset(
            "pruning", {"ratio": p / 100}, f"magnitude pruning of {p} % of the update (paper 002 Figs. 3/4)"
        )
        for p in (50, 90, 99)
    },
}  # fmt: skip


for _name, _preset in _PRESETS.items():
    PRESETS.register(
        _name, partial(Preset, _preset.defense, _preset.options, _preset.summary), summary=_preset.summary
    )
for _s in (0.001, 0.01, 0.1):  # paper 002's "DP" settings are batch_noise, which states no epsilon
    PRESETS.alias(f"dp_{_s:g}", f"batch_noise_{_s:g}", "batch_noise is not differential privacy: no epsilon")


def resolve(value: object, *, presets: bool = True) -> ComponentSpec:
    """A defense named in any of its forms as one :class:`ComponentSpec` of a registered defense: a
    registered name (which wins over a preset of the same name), a preset's name (its defense and options,
    options beside it overriding the preset's; labelled with the name as written), a ``(name, options)``
    pair or a ComponentSpec. The one place presets are resolved (configs, ``defend``, the Flower mods)."""
    spec = as_spec(value)
    if not presets or spec.name in DEFENSES or spec.name not in PRESETS:
        return spec
    preset = PRESETS.create(spec.name)
    extra = ", ".join(f"{k}={v}" for k, v in sorted(spec.options.items()))
    label = spec.label or (f"{spec.name}({extra})" if spec.options else spec.name)
    return ComponentSpec(preset.defense, {**preset.options, **spec.options}, label)

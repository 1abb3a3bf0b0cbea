"""One map per transformer family: where its parts are, for the attacks, the defenses and the benchmarks.

A :class:`TransformerFamily` says, per HF ``model_type``, where block ``i``'s attention and first MLP
projections take their input (module-name templates, ``{i}`` the block: DAGER's and MLP-SVD's span
channels, paper 002 Sec. III-C), which parameters are attention, MLP and embeddings (regular expressions
over module names: AEGIS's freeze and flood groups, paper 002 Sec. IV-D), whether weights are stored
(in, out) (HF ``Conv1D`` in GPT-2) or (out, in) (``nn.Linear``), how positions enter the first block
(learned: the layer-1 input depends on the position; rotary: it does not), and each task's output head
(Soteria's consumer layer). One registry, :data:`FAMILIES`, so a new family is one entry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

from gradleak.registry import Registry


@dataclass(frozen=True)
class TransformerFamily:
    """Where one transformer family's parts are (module docstring); DAGER's default thresholds too."""

    model_type: str
    attn_inputs: tuple[str, ...]  # module-name templates whose input is block i's attention input
    mlp_inputs: tuple[str, ...]  # module-name templates of block i's first MLP projection(s)
    embedding: str  # name suffix of the input token embedding module
    attention: str  # regex: the attention projections (Q/K/V/O, fused or separate)
    mlp: str  # regex: the MLP expansion and projection layers
    other_embeddings: str  # regex: learned positions, token types ("$^": none)
    conv1d: bool  # weights stored (in_features, out_features)
    positions: str  # "learned" (position-dependent layer-1 input) or "rotary" (position-free)
    token_types: bool  # BERT: token_type_ids enter the embedding
    causal: bool
    heads: Mapping[str, str] = field(default_factory=dict)  # task -> output head module name
    # a pre-norm block's parts a malicious server rewrites (peftleak_lora); "": not mapped for this family
    mlp_norm: str = ""  # template: the norm in front of block i's MLP
    attn_output: str = ""  # template: block i's attention output projection
    mlp_output: str = ""  # template: block i's MLP output projection
    position_embedding: str = ""  # name suffix of the learned position embedding ("": none or unmapped)
    block: str = ""  # template: block i itself (a bottleneck adapter sits on its input); "": not mapped
    l1_threshold: float = 1e-3
    l2_threshold: float = 1e-3
    rank_tol: float = 1e-8

    def __post_init__(self) -> None:
        if self.positions not in ("learned", "rotary"):
            raise ValueError(f"positions must be 'learned' or 'rotary', got {self.positions!r}")
        for key in ("attention", "mlp", "other_embeddings"):
            re.compile(getattr(self, key))

    @property
    def block_pattern(self) -> str:
        """Every block as a regex over module names (at a name boundary); never matches where unmapped."""
        if not self.block:
            return "$^"
        return r"(^|\.)" + re.escape(self.block).replace(r"\{i\}", r"\d+") + "$"

    @property
    def embedding_pattern(self) -> str:
        """The input token embedding as a regex over module names (at a name boundary)."""
        return rf"(^|\.){re.escape(self.embedding)}$"


# model_type -> its family; ``FAMILIES.create(model_type)`` builds the (frozen, equal-by-value) spec
FAMILIES: Registry[TransformerFamily] = Registry("transformer family")
FAMILIES.register(
    "gpt2",
    partial(
        TransformerFamily,
        "gpt2", attn_inputs=("h.{i}.attn.c_attn",), mlp_inputs=("h.{i}.mlp.c_fc",), embedding="wte",
        attention=r"(^|\.)h\.\d+\.attn\.(c_attn|q_attn|c_proj)$", mlp=r"(^|\.)h\.\d+\.mlp\.(c_fc|c_proj)$",
        other_embeddings=r"(^|\.)wpe$", conv1d=True, positions="learned", token_types=False, causal=True,
        heads={"causal_lm": "lm_head", "classification": "score"}, mlp_norm="h.{i}.ln_2",
        attn_output="h.{i}.attn.c_proj", mlp_output="h.{i}.mlp.c_proj", position_embedding="wpe",
        block="h.{i}",
    ),
)  # fmt: skip
FAMILIES.register(
    "llama",
    partial(
        TransformerFamily,
        "llama",
        attn_inputs=("layers.{i}.self_attn.q_proj", "layers.{i}.self_attn.k_proj",
                     "layers.{i}.self_attn.v_proj"),
        mlp_inputs=("layers.{i}.mlp.gate_proj", "layers.{i}.mlp.up_proj"), embedding="embed_tokens",
        attention=r"(^|\.)layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)$",
        mlp=r"(^|\.)layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)$", other_embeddings=r"$^", conv1d=False,
        positions="rotary", token_types=False, causal=True, heads={"causal_lm": "lm_head"},
        mlp_norm="layers.{i}.post_attention_layernorm", attn_output="layers.{i}.self_attn.o_proj",
        mlp_output="layers.{i}.mlp.down_proj", block="layers.{i}",
    ),
)  # fmt: skip
FAMILIES.register(
    "bert",
    partial(
        TransformerFamily,
        "bert",
        attn_inputs=("layer.{i}.attention.self.query", "layer.{i}.attention.self.key",
                     "layer.{i}.attention.self.value"),
        mlp_inputs=("layer.{i}.intermediate.dense",), embedding="embeddings.word_embeddings",
        attention=r"(^|\.)layer\.\d+\.attention\.(self\.(query|key|value)|output\.dense)$",
        mlp=r"(^|\.)layer\.\d+\.(intermediate\.dense|output\.dense)$",
        other_embeddings=r"(^|\.)embeddings\.(position_embeddings|token_type_embeddings)$", conv1d=False,
        positions="learned", token_types=True, causal=False, heads={"classification": "classifier"},
        block="layer.{i}",
    ),
)  # fmt: skip

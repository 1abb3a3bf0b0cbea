"""PEFTLeak's malicious server on a LoRA language model: a pass-through backbone, Robbing the Fed's bins in
the frozen MLP's activation, read off the adapters' ``A`` gradient.

Sami et al., "Gradient Inversion Attacks on Parameter-Efficient Fine-Tuning" (PEFTLeak, CVPR 2025, code
info-ucr/PEFTLeak), threat model: the server ships the frozen pretrained backbone and the initial adapters,
and sees one client's adapter update. PEFTLeak sets a ViT's norms, attention and MLPs to pass the patch
embeddings through, and uses the bottleneck adapter's own nonlinearity as Fowl et al.'s imprint bins
("Robbing the Fed", ICLR 2022; :mod:`gradleak.attacks.linear.imprint`). A LoRA adapter
(``h = W x + s B A x``, :mod:`gradleak.models.adapters`) has no nonlinearity of its own, so here the bins
are the frozen MLP's activation and the adapter on its input projection only reads them. What the server
writes (:meth:`PeftLeakLoRA.prepare`), for a pre-norm decoder (GPT-2, Llama; the family map's
``attn_output``, ``mlp_output``, ``mlp_norm``):

1. **Pass-through.** Every attention output projection is zero, so block ``l``'s MLP reads
   ``x_t = norm(e_t)``, ``e_t`` the token's embedding (plus its learned position embedding): a function of
   token ``t``'s own id and position, which the server can compute for every candidate. Every MLP output
   projection is zero except the bin units' columns below; every adapter ``A`` and ``B`` starts at zero.
2. **Bins.** In each adapted block, ``r`` units ``j`` of the MLP's gating projection (GPT-2's ``c_fc`` with
   GELU, Llama's ``gate_proj`` with SiLU) compute ``pre_j = k (<a, x_t> - c_j)`` for a random direction
   ``a`` (unit spread over the candidates), a sharpness ``k`` and cuts ``c_1 < ... < c_r`` at the
   quantiles of ``<a, x>`` over the candidates (the server has no public text: candidates drawn uniformly
   over the vocabulary and positions). The cut is the unit's bias; Llama's gate has none, so the server
   gives every token embedding one coordinate ``q`` whose normed value is a constant ``gamma`` (each row
   rescaled so its RMS is 1; the norm's output is scale-free, so no token's direction changes elsewhere; a
   tied LM head changes with the embeddings, which the attack does not need) and writes
   ``-k c_j / gamma`` there; Llama's ``up_proj`` rows of the bin units read ``1 / gamma`` times that
   coordinate, so the SiLU gate is multiplied by 1.
3. **Back-connection and read-out.** Every bin unit's column of the MLP output projection is one shared
   vector ``eps v`` (``eps`` so small that the residual moves by ``leak_scale`` of its norm), and the
   adapter's ``B`` reads unit ``j`` into rank ``j`` (``B[j, j] = 1``). With ``A = 0`` the adapter changes
   nothing in the forward pass, and

       dL/dA_j = s (B^T dL/dpre_t)_j x_t summed over t = s eps sum_{t: <a, x_t> > c_j} g_t x_t,

   with ``g_t = <v, dL/de_t>``, because ``phi'(pre_j)`` is a step for a large ``k`` (GELU and SiLU alike).
   Consecutive rows differ by ``s eps sum_{t in bin j} g_t x_t``: a bin holding one token gives its
   ``x_t`` up to scale and sign, matched against every candidate's features by ``|cos|``
   (``min_cosine``). Mixed bins match nothing and are dropped.

Every adapted block carries its own bins (another direction and cuts), so ``r`` bins per block, and a token
any block isolates is read. A learned position embedding (GPT-2) makes the match a (token, position) pair:
where each position holds at most one recovered token (one sentence) the attack returns it as an ordered
sequence, else the recovered tokens as an unordered set (scored against the batch's tokens). Rotary
positions (Llama) give tokens without positions: always a set. The blocks after the first read the residual
plus the bins' outputs of the blocks before, ``leak_scale`` (1e-4) of its norm: candidates are computed
without them, well inside ``min_cosine``.

Where it stops, stated as its threat model: the client must adapt the MLP's gating projection (``target``
includes ``"mlp"``; on attention-only LoRA no per-token nonlinearity sits in front of an adapter's
gradient, and the attack refuses); a causal LM's last token is only a label (its position has no loss, so
``g_t = 0``), and a classifier's loss reaches only its last token; a bin isolates a token only when no other
token of the batch falls in it (``r`` bins per block against the batch's tokens, Robbing the Fed's
birthday limit); adapter dropout would change ``x_t`` in the adapter's path. FedAvg keeps it exact: the
embeddings are frozen and the attention zero, so ``x_t`` never moves, and every local step adds to the same
bins (the adapter's own forward term stays ``eps``-small).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradleak.attacks.linear.imprint import cut_points, normalised_direction
from gradleak.attacks.text.family import (
    FamilySpec,
    family_of,
    find_module,
    input_embedding,
    lora_weights,
    update_tensor,
)
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

MIN_COORDINATES = 8  # a (masked) bin difference on fewer coordinates matches too much to count
# activations whose derivative is a step far from zero (the bins) and whose value is ~0 below it
GATING_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")


@dataclass(frozen=True)
class PeftLeakLoRAConfig:
    """``blocks``: how many adapted blocks carry bins (None: every one); ``sharpness`` the bins' gain ``k``
    in units of the measurement's spread; ``leak_scale`` the bins' largest output relative to the smallest
    residual (how far later blocks' inputs move); ``min_cosine`` the ``|cos|`` a bin difference needs with
    a candidate's features to count as that token; ``rel_tol`` the fraction of the largest bin difference
    under which a bin is empty; ``sample`` the (token, position) candidates drawn to place the cuts, over
    the first ``positions`` positions (the sequence length the server expects; None: every position the
    model has; nothing to choose with rotary positions)."""

    blocks: int | None = None
    positions: int | None = None
    sharpness: float = 1e3
    leak_scale: float = 1e-4
    min_cosine: float = 0.999
    rel_tol: float = 1e-6
    sample: int = 20000

    def __post_init__(self) -> None:
        for key in ("blocks", "positions"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{key} must be None or an int >= 1, got {v!r}")
        for key in ("sharpness", "leak_scale", "min_cosine"):
            v = getattr(self, key)
            if isinstance(v, bool) or not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{key} must be a positive finite number, got {v!r}")
        if self.leak_scale > 1e-2:  # later blocks' inputs would move past what the match tolerates
            raise ValueError(f"leak_scale must be <= 0.01 (module docstring), got {self.leak_scale!r}")
        if self.min_cosine > 1:
            raise ValueError(f"min_cosine must be in (0, 1], got {self.min_cosine!r}")
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in [0, 1), got {self.rel_tol!r}")
        if isinstance(self.sample, bool) or not isinstance(self.sample, int) or self.sample < 2:
            raise ValueError(f"sample must be an int >= 2, got {self.sample!r}")


def base_of(module: nn.Module) -> nn.Module:
    """The frozen layer under a peft LoRA wrapper (the module itself where none wraps it)."""
    return getattr(module, "base_layer", module)


def tensor_of(module: nn.Module, name: str) -> torch.Tensor | None:
    """The frozen layer's ``weight`` or ``bias`` (None where it has none)."""
    t = getattr(base_of(module), name, None)
    return t if isinstance(t, torch.Tensor) else None


def weight_of(module: nn.Module) -> torch.Tensor:
    weight = tensor_of(module, "weight")
    if weight is None:
        raise AttackInputError(f"{type(module).__name__} has no weight to rewrite")
    return weight


def out_in(module: nn.Module, spec: FamilySpec) -> torch.Tensor:
    """The layer's weight as (out, in), a view (GPT-2's ``Conv1D`` stores (in, out))."""
    weight = weight_of(module)
    return weight.T if spec.conv1d else weight


def lora_param(model: nn.Module, module_name: str, which: str) -> str | None:
    """The name of ``module_name``'s LoRA ``which`` (``"A"``/``"B"``) weight, None where it has no adapter."""
    hits = lora_weights((n for n, _ in model.named_parameters()), module_name, which)
    if len(hits) > 1:
        raise AttackInputError(
            f"{module_name!r} carries several LoRA adapters ({hits}): peftleak_lora reads one"
        )
    return hits[0] if hits else None


def block_count(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or count < 1:
        raise AttackInputError("the model's config states no num_hidden_layers")
    return count


def activation_of(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    act = getattr(config, "activation_function", None) or getattr(config, "hidden_act", None)
    if act not in GATING_ACTIVATIONS:
        raise AttackInputError(
            f"peftleak_lora needs a gating MLP activation {GATING_ACTIVATIONS}, got {act!r}"
        )
    return str(act)


def residuals(
    model: nn.Module, spec: FamilySpec, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The pass-through residual of each (token, position): its embedding plus its learned position's."""
    e = input_embedding(model).weight[tokens]
    if spec.position_embedding:
        _, pos = find_module(model, spec.position_embedding)
        e = e + weight_of(pos)[positions]
    return e


@torch.no_grad()
def mlp_inputs(
    model: nn.Module, spec: FamilySpec, block: int, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """What block ``block``'s MLP reads for each (token, position) under the pass-through backbone, in
    float64: the block's MLP norm of the residual (the bins of earlier blocks left out, module docstring)."""
    _, norm = find_module(model, spec.mlp_norm.format(i=block))
    return norm(residuals(model, spec, tokens, positions)).to(torch.float64)


def candidate_positions(model: nn.Module, spec: FamilySpec, max_tokens: int | None) -> list[int | None]:
    """The positions a candidate can take: the first ``max_tokens`` (None: all) the learned position
    embedding has, or one position-free set with rotary positions."""
    if not spec.position_embedding:
        return [None]
    _, pos = find_module(model, spec.position_embedding)
    known = int(weight_of(pos).shape[0])
    return list(range(known if max_tokens is None else min(max_tokens, known)))


class PeftLeakLoRA:
    """PEFTLeak's malicious server on a LoRA language model; see the module docstring."""

    def __init__(self, config: PeftLeakLoRAConfig | None = None) -> None:
        self.config = config or PeftLeakLoRAConfig()

    def prepare(
        self, model: nn.Module, public_images: torch.Tensor | None, *, generator: torch.Generator
    ) -> tuple[nn.Module, Mapping[str, object]]:
        cfg = self.config
        spec = family_of(model)
        if not (spec.mlp_norm and spec.attn_output and spec.mlp_output):
            raise AttackInputError(
                f"peftleak_lora: no pass-through map for the {spec.model_type!r} family (pre-norm decoders: "
                "gpt2, llama)"
            )
        act = activation_of(model)
        malicious = copy.deepcopy(model)
        count = block_count(malicious)
        gates = [find_module(malicious, spec.mlp_inputs[0].format(i=i)) for i in range(count)]
        adapted = [(i, n, m) for i, (n, m) in enumerate(gates) if lora_param(malicious, n, "A") is not None]
        if not adapted:
            raise AttackInputError(
                f"peftleak_lora reads the LoRA A gradient of the MLP's gating projection "
                f"({spec.mlp_inputs[0]}), which this model does not adapt: the adapter's target must include "
                "'mlp' (attention-only LoRA has no per-token nonlinearity in front of an adapter)"
            )
        adapted = adapted[: cfg.blocks]
        up = len(spec.mlp_inputs) > 1  # Llama: the gate multiplies an up projection
        with torch.no_grad():
            for name, p in malicious.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    p.zero_()
            for i in range(count):
                for template in (spec.attn_output, spec.mlp_output):
                    layer = find_module(malicious, template.format(i=i))[1]
                    for t in (weight_of(layer), tensor_of(layer, "bias")):
                        if t is not None:
                            t.zero_()
            for i, _, _ in adapted:
                norm = find_module(malicious, spec.mlp_norm.format(i=i))[1]
                weight_of(norm).fill_(1.0)
                bias = tensor_of(norm, "bias")
                if bias is not None:
                    bias.zero_()
            biased = all(tensor_of(m, "bias") is not None for _, _, m in adapted)
            constant = None if biased and not up else self._constant_coordinate(malicious, generator)
            vocab = input_embedding(malicious).num_embeddings
            tokens = torch.randint(0, vocab, (cfg.sample,), generator=generator)
            span = len(candidate_positions(malicious, spec, cfg.positions))  # rotary: one set
            positions = torch.randint(0, span, (cfg.sample,), generator=generator)
            sample = (tokens, positions)
            names = [
                self._plant(malicious, spec, block, sample, constant, up, _activation(act), generator)
                for block, _, _ in adapted
            ]
        return malicious, {"attack": "peftleak_lora", "lora_a": names, "blocks": len(names)}

    @staticmethod
    def _constant_coordinate(model: nn.Module, generator: torch.Generator) -> tuple[int, float]:
        """Give every token embedding coordinate ``q`` the value ``gamma``, the rest rescaled so that the
        row's RMS is 1 (module docstring, step 2): an RMS norm (weight 1) then outputs ``gamma`` there for
        every token and the token's own direction elsewhere. Returns ``(q, gamma)``."""
        emb = input_embedding(model).weight
        d = emb.shape[1]
        q = int(torch.randint(0, d, (1,), generator=generator))
        gamma = 1.0
        rest = emb.detach().to(torch.float64).clone()
        rest[:, q] = 0
        rest = rest / rest.norm(dim=1, keepdim=True).clamp_min(1e-30) * math.sqrt(d - gamma**2)
        rest[:, q] = gamma
        emb.copy_(rest.to(emb.dtype))
        return q, gamma

    def _plant(
        self,
        model: nn.Module,
        spec: FamilySpec,
        block: int,
        sample: tuple[torch.Tensor, torch.Tensor],
        constant: tuple[int, float] | None,
        up: bool,
        activation: Any,
        generator: torch.Generator,
    ) -> str:
        """Block ``block``'s bins (module docstring, steps 2 and 3); returns its LoRA A's parameter name."""
        cfg = self.config
        name, module = find_module(model, spec.mlp_inputs[0].format(i=block))
        a_name, b_name = lora_param(model, name, "A"), lora_param(model, name, "B")
        if a_name is None or b_name is None:
            raise AttackInputError(f"{name!r} has no LoRA A and B to plant bins in")
        r = model.get_parameter(a_name).shape[0]
        gate = out_in(module, spec)
        if r > gate.shape[0] or self.config.sample <= r:
            raise AttackInputError(
                f"{name!r}: {r} bins need at least {r} gate units (it has {gate.shape[0]}) and more than {r} "
                f"sampled candidates to place their cuts (sample = {self.config.sample})"
            )
        x = mlp_inputs(model, spec, block, *sample)  # (n, d) float64
        direction = torch.randn(x.shape[1], generator=generator, dtype=torch.float64)
        if constant is not None:
            direction[constant[0]] = 0.0
        direction, measured = normalised_direction(direction, x)
        cuts = cut_points(measured, r)
        kappa = cfg.sharpness
        gate.zero_()
        gate[:r] = (kappa * direction).to(gate.dtype)
        bias = tensor_of(module, "bias")
        if constant is None and bias is not None:
            bias[:r] = (-kappa * cuts).to(gate.dtype)
        elif constant is not None:
            q, gamma = constant
            gate[:r, q] = (-kappa * cuts / gamma).to(gate.dtype)
            if up:
                up_w = out_in(find_module(model, spec.mlp_inputs[1].format(i=block))[1], spec)
                up_w.zero_()
                up_w[:r, q] = 1.0 / gamma
        # eps: the bins' largest summed output, over the sample, leak_scale of the smallest residual
        pre = kappa * (measured[:, None] - cuts[None, :])
        total = activation(pre).sum(dim=1).abs().max().clamp_min(1e-30)
        smallest = residuals(model, spec, *sample).to(torch.float64).norm(dim=1).min()
        eps = float(cfg.leak_scale * smallest / total)
        v = torch.randn(gate.shape[1], generator=generator, dtype=torch.float64)
        out = out_in(find_module(model, spec.mlp_output.format(i=block))[1], spec)
        out[:, :r] = (eps * v / v.norm())[:, None].to(out.dtype)
        if not bool(out[:, :r].abs().amax(dim=0).gt(0).all()):  # e.g. float16: eps underflows to zero
            raise AttackInputError(
                f"{name!r}: the bins' shared output column ({eps:.1e} x a unit vector) underflows in "
                f"{out.dtype}; raise leak_scale or attack a float32 model"
            )
        model.get_parameter(b_name)[:r, :r] = torch.eye(r, dtype=gate.dtype)
        return a_name

    @staticmethod
    def differences(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Consecutive bin rows' differences (the last row against zero), and the coordinates they hold:
        every one."""
        diff = rows - torch.cat([rows[1:], torch.zeros_like(rows[:1])])
        return diff, torch.ones_like(diff, dtype=torch.bool)

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        cfg = self.config
        names = obs.secrets.get("lora_a")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise AttackInputError("no peftleak_lora secrets (lora_a) in the observation")
        start = time.perf_counter()
        model, spec = obs.model, family_of(obs.model)
        parts = [self.differences(update_tensor(obs, name)) for name in names]  # rows: tokens above cut j
        diff, mask = torch.cat([d for d, _ in parts]), torch.cat([m for _, m in parts])
        norms = (diff * mask).norm(dim=1)
        keep = (norms > cfg.rel_tol * float(norms.max().clamp_min(1e-300))) & (
            mask.sum(dim=1) >= MIN_COORDINATES
        )
        live, mask = diff[keep] * mask[keep], mask[keep]
        first = first_block(model, spec, names[0])
        best = torch.zeros(len(live), dtype=torch.float64)  # per bin difference: its best |cos| so far
        match: list[tuple[int, int | None] | None] = [None] * len(live)
        if len(live):
            unit = live / live.norm(dim=1, keepdim=True)
            vocab = torch.arange(input_embedding(model).num_embeddings)
            whole = bool(mask.all())
            for p in candidate_positions(model, spec, obs.input_shape[0]):
                x = mlp_inputs(model, spec, first, vocab, torch.full_like(vocab, 0 if p is None else p))
                if whole:
                    cos, token = (unit @ x.T).abs().div(x.norm(dim=1).clamp_min(1e-300)).max(dim=1)
                else:  # each difference against the candidates on its kept coordinates (unit is 0 off them)
                    norms = (mask.to(x.dtype) @ (x * x).T).sqrt().clamp_min(1e-300)  # (live, V)
                    cos, token = ((unit @ x.T).abs() / norms).max(dim=1)
                for k in torch.nonzero(cos > best).reshape(-1).tolist():
                    best[k], match[k] = cos[k], (int(token[k]), p)
        # a bin difference is the (token, position) it matches best, if that match is close enough
        pairs = sorted(
            {m for m, c in zip(match, best.tolist(), strict=True) if m is not None and c >= cfg.min_cosine}
        )
        positions = [p for _, p in pairs]
        one = obs.update.num_samples == 1  # positions order a single sentence, not a batch's tokens
        ordered = one and bool(pairs) and None not in positions and len(set(positions)) == len(positions)
        tokens = (
            [t for _, t in sorted((p, t) for t, p in pairs)] if ordered else sorted({t for t, _ in pairs})
        )
        stats = {
            "seconds": time.perf_counter() - start,
            "bins": float(len(diff)),
            "bins_live": float(len(live)),
            "recovered": float(len(pairs)),
        }
        return Reconstruction(token_ids=[tokens] if tokens else [], stats=stats, ordered=ordered)


def first_block(model: nn.Module, spec: FamilySpec, a_name: str) -> int:
    """The block whose MLP gating projection carries the LoRA A named ``a_name``."""
    for i in range(block_count(model)):
        name, _ = find_module(model, spec.mlp_inputs[0].format(i=i))
        if a_name.startswith(f"{name}.lora_A."):
            return i
    raise AttackInputError(f"{a_name!r} is no LoRA A of an MLP gating projection")


def _activation(name: str) -> Any:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class PeftLeakLoRAMasked(PeftLeakLoRA):
    """``peftleak_lora`` against gradient pruning (an adaptive server that knows the defense): pruning zeroes
    each tensor's smallest entries, so a kept entry is exact and a zero is unknown. Two consecutive bin rows
    differ exactly by one bin's tokens on the coordinates both kept (the top bin: wherever it kept one), and
    each difference is matched against the candidates on those coordinates alone (a row with no entry
    left is a true zero: above the batch's highest token). On the GPT-2 arch tiny (r = 32, four sentences,
    15 visible tokens): 13 at 50 % pruning, 9 at 90 % (``peftleak_lora``: 0 at both; 13 unpruned, as the
    masked variant), all of them true."""

    @staticmethod
    def differences(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        below = torch.cat([rows[1:], torch.zeros_like(rows[:1])])
        empty = ~below.any(dim=1, keepdim=True)  # above the batch's highest token a row is truly zero
        kept = (rows != 0) & ((below != 0) | empty)
        return (rows - below) * kept, kept


ATTACKS.register(
    "peftleak_lora",
    PeftLeakLoRA,
    config_cls=PeftLeakLoRAConfig,
    summary="malicious server: PEFTLeak's pass-through backbone, bins in the MLP read by LoRA A (text)",
    modality="text",
)

ATTACKS.register(
    "peftleak_lora_masked",
    PeftLeakLoRAMasked,
    config_cls=PeftLeakLoRAConfig,
    summary="peftleak_lora against pruning: bins read on the coordinates both rows kept (adaptive)",
    modality="text",
)

__all__ = ["PeftLeakLoRA", "PeftLeakLoRAConfig", "PeftLeakLoRAMasked"]

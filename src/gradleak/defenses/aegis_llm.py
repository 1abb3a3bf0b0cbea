"""AEGIS (paper 002): triple-channel gradient masking for federated transformer fine-tuning.

Three client-side operations close the three analytical channels that DAGER and its relatives read:

1. **Freeze attention** (Eq. 1, Channel 1): every attention projection (Q/K/V/O, fused or separate) gets
   ``requires_grad = False`` in :meth:`AegisLLM.setup`, *before* the client builds its optimiser, so its
   gradient is exactly zero, its weights never change, and the exported slot is zero.
2. **Flood the embedding gradient** (Eq. 2, Channel 2), after every backward pass and before the optimiser
   step.
3. **Flood the MLP gradients** (Eq. 4, Channel 3): the expansion and the projection matrices of every block;
   LayerNorm/RMSNorm gradients and an untied LM head are flooded too (paper 002, App. "Hyperparameter
   details" and Sec. IV-C), so that no clean fallback channel remains.

The local optimiser steps on the flooded gradients, and the same flooded gradient is what leaves the client
(FedSGD: the gradient itself; FedAvg: the delta the optimiser produced from it).

**Reading of Eq. 2 and Eq. 4** (the equations are absent from the paper text; this is gradleak's reading of
the surrounding prose, Sec. IV-C/D, Theorem 2's proof and the Marchenko-Pastur remark):

    g~[v, :] = rho * g[v, :] * 1[v active] + n_v,     n_v ~ N(0, (lambda * m_bar)^2 I)   for every row v,
    m_bar    = mean_{v active} ||g[v, :]||,            v active  <=>  ||g[v, :]|| > tau * max_u ||g[u, :]||.

* "Rows" are the slices of the gradient indexed by the layer's *input* side: the token rows of an
  embedding (V x d) and of an untied LM head (V x d, one row per output token), the input-feature slices of
  an MLP matrix (rows of a GPT-2 ``Conv1D`` weight stored (in, out), columns of an ``nn.Linear`` weight
  stored (out, in)), and single entries of 1-D tensors (biases, LayerNorm weight and bias).
* The noise is i.i.d. per entry with standard deviation ``lambda * m_bar`` (so a flooded row has norm about
  ``lambda * m_bar * sqrt(width)``): this is the scale under which the paper's bulk edge
  ``sigma_fc (sqrt(d) + sqrt(4d)) = 3 sigma_fc sqrt(d) ~ 83 m_bar_fc`` at ``lambda_fc = 1, d = 768`` holds
  (``sigma_fc = lambda_fc * m_bar_fc``), and under which Theorem 2's inflation ratio
  ``rho^2 C^2 / (d lambda^2)`` is computed.
* "Relative-norm rule" (Sec. III, after Definition 2): a row is active when its norm exceeds ``tau`` times
  the largest row norm (``active_rel_tol``, default 1e-2); excluded rows carry only noise. With a tied LM
  head every embedding row is nonzero (the softmax term touches all V rows), so a near-zero ``tau`` would
  average ``m_bar`` over ~50k tiny rows and the batch's rows would stand out above the flood (measured on
  GPT-2 from config: batch rows have >= 0.40 x the largest norm, all other rows <= 7e-4 x; 0.01 separates
  them, and a larger ``tau`` only raises the noise). If no row is
  active (the tensor's gradient is exactly zero) the tensor is left at zero: there is nothing to hide and
  no scale to calibrate against.
* Defaults (paper 002, Sec. VI-A and App.): ``(lambda, rho) = (1.0, 0.3)`` on the embedding and untied head,
  ``(lambda_fc, rho_fc) = (8.0, 0.0)`` on MLP matrices (and their biases), ``lambda_ln = 4.0`` on norms with
  ``rho_ln = 1.0`` (the paper gives no retain ratio for norms; 1 keeps their learning signal, which is not
  one of the channels). The paper's MLP/LN scales are reduced for bf16 weights ("halve" in the text, 8 -> 2
  and 4 -> 1 in its numbers); gradleak multiplies them by ``bf16_scale = 0.5`` when a gradient is bf16.
* Steps whose total gradient norm is non-finite are skipped: every gradient is set to ``None`` (optimisers
  skip parameters without a gradient) and the count is logged; a FedSGD client then has nothing to send and
  fails closed (:func:`gradleak.tasks.text_client.fedsgd_text_update`).

Other embedding tables (GPT-2's learned positions, BERT's positions and token types) are flooded with the
embedding rule when ``flood_other_embeddings`` is set (default): their row norms would otherwise reveal the
batch's sequence lengths. Component switches give the paper's ablations (Table II, Table V): AEGIS-2ch is
``flood_mlp = false``. ``mlp_blocks`` floods the MLP of the named blocks only (numbered from 1, as
``mlp_spectral``'s ``snr_block{i}``), the others' MLP gradients leaving whole: not in the paper, a knob for
issue 21's search for the smallest MLP protection (block 1's MLP input is the token embeddings themselves,
the one MLP channel ``mlp_spectral`` reads tokens from).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradleak.defenses.base import Defense, SetupContext
from gradleak.device import generator_on
from gradleak.models.adapters import is_adapter_parameter
from gradleak.models.families import FAMILIES, TransformerFamily
from gradleak.registry import DEFENSES

log = logging.getLogger(__name__)


def _module_from(model: nn.Module, getter: str) -> nn.Module | None:
    """``model.get_input_embeddings()`` / ``get_output_embeddings()`` when the model has it, else None."""
    fn: Any = getattr(model, getter, None)
    out = fn() if callable(fn) else None
    return out if isinstance(out, nn.Module) else None


def _block_of(module_name: str) -> int:
    """The block number (from 1) of a transformer block's module: the first index in its dotted name
    (``h.0.mlp.c_fc``, ``model.layers.3.mlp.up_proj``, ``encoder.layer.5.intermediate.dense``)."""
    index = re.search(r"(^|\.)(\d+)\.", module_name)
    if index is None:
        raise ValueError(f"aegis_llm: no block index in the MLP module name {module_name!r}")
    return int(index.group(2)) + 1


def _is_norm(module: nn.Module) -> bool:
    kind = type(module).__name__
    return isinstance(module, nn.LayerNorm) or kind.endswith("LayerNorm") or kind.endswith("RMSNorm")


# What AEGIS's three channels mean when only adapters train (issue 52, item 3; LoRA here, bottleneck
# adapters alike): the base's attention, embeddings and MLP are frozen already, so channel 1's freeze is
# moot and channel 2 is closed by construction; what the update carries is the adapters, whose gradients
# (dL/dB = delta (A x)^T, dL/dA = B^T delta x^T; a bottleneck's dL/dW_down = sum_t g_t x_t^T) are the channels
# dager_lora and utr read, and paper 002 gives no rule for them (freezing attention adapters stops the
# training; its MLP flood keeps none of the signal, rho_fc = 0)
ADAPTERS_REFUSED = (
    "aegis_llm is defined on full fine-tuning (paper 002); this model trains adapters only "
    "({example!r}, ...): the base's attention, embeddings and MLP are frozen already (AEGIS's freeze is "
    "moot, its embedding channel closed), and the adapters' own gradients, which dager_lora and utr read, "
    "have no AEGIS rule. Defend an adapter update with update_noise, dp_sgd or pruning (docs/lora.md)"
)


@dataclass(frozen=True)
class AegisLLMConfig:
    """AEGIS hyper-parameters (paper 002 defaults) and component switches (for the ablations)."""

    lam: float = 1.0  # embedding (and untied LM head) flood scale lambda
    rho: float = 0.3  # embedding retain ratio
    lam_fc: float = 8.0  # MLP flood scale
    rho_fc: float = 0.0  # MLP retain ratio (0: the privacy-hardening endpoint)
    lam_ln: float = 4.0  # LayerNorm / RMSNorm flood scale
    rho_ln: float = 1.0  # norm retain ratio (not given by the paper)
    bf16_scale: float = 0.5  # multiplies lam_fc and lam_ln for bf16 gradients
    active_rel_tol: float = 1e-2  # relative-norm rule for active rows
    freeze_attention: bool = True
    flood_embedding: bool = True
    flood_mlp: bool = True
    flood_layernorm: bool = True
    flood_lm_head: bool = True  # only acts when the head is untied
    flood_other_embeddings: bool = True
    mlp_blocks: tuple[int, ...] = ()  # the blocks (numbered from 1) whose MLP is flooded; (): every block

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_blocks", tuple(self.mlp_blocks))  # a config's list
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.mlp_blocks):
            raise ValueError(f"aegis_llm: mlp_blocks must be block numbers >= 1, got {self.mlp_blocks!r}")
        if len(set(self.mlp_blocks)) != len(self.mlp_blocks):
            raise ValueError(f"aegis_llm: mlp_blocks repeats a block: {self.mlp_blocks!r}")
        for name in ("lam", "lam_fc", "lam_ln", "rho", "rho_fc", "rho_ln", "bf16_scale", "active_rel_tol"):
            value = getattr(self, name)
            if not (
                isinstance(value, int | float) and value >= 0 and value == value and value != float("inf")
            ):
                raise ValueError(f"aegis_llm: {name} must be a finite number >= 0, got {value!r}")
        if self.active_rel_tol >= 1:
            raise ValueError(f"aegis_llm: active_rel_tol must be < 1, got {self.active_rel_tol}")


@dataclass(frozen=True)
class FloodRule:
    """How one parameter is flooded: ``rows`` says which axis indexes the rows (see the module docstring)."""

    group: str  # embedding | lm_head | mlp | norm
    lam: float
    rho: float
    rows: str  # "dim0" (rows are dim 0), "dim1" (rows are dim 1), "entries" (1-D: each entry a row)


def row_norms(grad: torch.Tensor, rows: str) -> torch.Tensor:
    """Norms of the gradient's rows (see :class:`FloodRule`)."""
    g = grad.float()
    if rows == "entries":
        return g.abs().reshape(-1)
    if rows == "dim0":
        return g.reshape(g.shape[0], -1).norm(dim=1)
    if rows == "dim1":
        return g.norm(dim=0)
    raise ValueError(f"unknown row layout {rows!r}")


def flood(
    grad: torch.Tensor,
    *,
    lam: float,
    rho: float,
    rows: str,
    generator: torch.Generator,
    active_rel_tol: float = 1e-2,
) -> tuple[torch.Tensor, float]:
    """Eq. 2 / Eq. 4 as read here: ``rho * g`` on active rows plus ``N(0, (lam * m_bar)^2)`` everywhere.

    Returns the flooded gradient (same dtype and shape) and ``m_bar`` (0.0 when no row is active, in which
    case the zero gradient is returned unchanged).
    """
    norms = row_norms(grad, rows)
    top = float(norms.max()) if norms.numel() else 0.0
    if top == 0.0:
        return grad.clone(), 0.0
    active = norms > active_rel_tol * top
    m_bar = float(norms[active].mean())
    if rows == "entries":
        mask = active.reshape(grad.shape)
    elif rows == "dim0":
        mask = active.reshape(-1, *([1] * (grad.dim() - 1)))
    else:
        mask = active.reshape(1, -1)
    out = torch.randn(grad.shape, generator=generator, dtype=torch.float32, device=generator.device)
    out = out.to(grad.device).mul_(lam * m_bar)
    if rho:
        out.addcmul_(grad.float(), mask.to(torch.float32), value=rho)
    return out.to(grad.dtype), m_bar


class AegisLLM(Defense):
    """Freeze attention in :meth:`setup`; flood embedding, MLP, norm and untied-head gradients in
    :meth:`on_gradients` (see the module docstring for the equations and defaults)."""

    name = "aegis_llm"
    adapters = False  # ADAPTERS_REFUSED

    def __init__(self, config: AegisLLMConfig | None = None) -> None:
        self.config = config or AegisLLMConfig()
        self.rules: dict[str, FloodRule] = {}
        self.frozen: list[str] = []
        self.generator: torch.Generator | None = None
        self.device_generators: dict[torch.device, torch.Generator] = {}
        self.skipped_steps = 0

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        generator = context.generator
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if not isinstance(model_type, str) or model_type not in FAMILIES:
            raise ValueError(
                f"aegis_llm: no parameter map for model_type {model_type!r}; known: {FAMILIES.names()}"
            )
        adapters = [n for n, p in model.named_parameters() if p.requires_grad and is_adapter_parameter(n)]
        if adapters:
            raise ValueError(ADAPTERS_REFUSED.format(example=adapters[0]))
        self.generator = generator
        self.device_generators = {generator.device: generator}
        self.skipped_steps = 0
        parts = FAMILIES.create(model_type)
        self.frozen = self._freeze(model, parts) if self.config.freeze_attention else []
        self.rules = self._rules(model, parts)
        log.info(
            "aegis_llm: froze %d attention tensors, floods %d tensors", len(self.frozen), len(self.rules)
        )

    def _freeze(self, model: nn.Module, parts: TransformerFamily) -> list[str]:
        frozen = []
        for mod_name, module in model.named_modules():
            if re.search(parts.attention, mod_name):
                for p_name, p in module.named_parameters(recurse=False):
                    p.requires_grad_(False)
                    p.grad = None
                    frozen.append(f"{mod_name}.{p_name}")
        if not frozen:
            raise ValueError("aegis_llm: found no attention projection to freeze")
        return frozen

    def _rules(self, model: nn.Module, parts: TransformerFamily) -> dict[str, FloodRule]:
        cfg = self.config
        emb, head = _module_from(model, "get_input_embeddings"), _module_from(model, "get_output_embeddings")
        untied_head = head is not None and emb is not None and head.weight is not emb.weight
        by_id: dict[int, FloodRule] = {}
        names: dict[int, str] = {}
        mlp_blocks: set[int] = set()  # the model's blocks that have an MLP
        for mod_name, module in model.named_modules():
            rule: FloodRule | None = None
            matrix_rows = "dim0" if parts.conv1d else "dim1"
            if module is emb or re.search(parts.embedding_pattern, mod_name):
                rule = FloodRule("embedding", cfg.lam, cfg.rho, "dim0") if cfg.flood_embedding else None
            elif re.search(parts.other_embeddings, mod_name):
                rule = (
                    FloodRule("embedding", cfg.lam, cfg.rho, "dim0") if cfg.flood_other_embeddings else None
                )
            elif untied_head and module is head:
                rule = FloodRule("lm_head", cfg.lam, cfg.rho, "dim0") if cfg.flood_lm_head else None
            elif re.search(parts.mlp, mod_name):
                block = _block_of(mod_name)
                mlp_blocks.add(block)
                flooded = cfg.flood_mlp and (not cfg.mlp_blocks or block in cfg.mlp_blocks)
                rule = FloodRule("mlp", cfg.lam_fc, cfg.rho_fc, matrix_rows) if flooded else None
            elif _is_norm(module):
                rule = FloodRule("norm", cfg.lam_ln, cfg.rho_ln, "entries") if cfg.flood_layernorm else None
            if rule is None:
                continue
            for p_name, p in module.named_parameters(recurse=False):
                if not p.requires_grad or id(p) in by_id:  # a tied head's weight is the embedding's
                    continue
                by_id[id(p)] = rule if p.dim() > 1 else FloodRule(rule.group, rule.lam, rule.rho, "entries")
                names[id(p)] = f"{mod_name}.{p_name}"
        if cfg.flood_embedding and (emb is None or id(emb.weight) not in by_id):
            raise ValueError("aegis_llm: the model's input token embedding was not found or is frozen")
        missing = sorted(set(cfg.mlp_blocks) - mlp_blocks)
        if missing:
            raise ValueError(
                f"aegis_llm: mlp_blocks {missing} name no block of the model (its MLP blocks are "
                f"1..{max(mlp_blocks, default=0)})"
            )
        return {names[i]: r for i, r in by_id.items()}

    def _generator_for(self, device: torch.device, base: torch.Generator) -> torch.Generator:
        """The noise generator for gradients on ``device``: the setup generator ``base`` on its own device,
        else one generator per device seeded once from it (no host-to-device copy of the noise each step)."""
        if device not in self.device_generators:
            self.device_generators[device] = generator_on(device, base)
        return self.device_generators[device]

    @torch.no_grad()
    def on_gradients(self, model: nn.Module, step: int, **_: Any) -> None:
        if self.generator is None:
            raise RuntimeError("aegis_llm needs setup() before on_gradients()")
        params = dict(model.named_parameters())
        grads = [p.grad for p in params.values() if p.grad is not None]
        total = torch.stack([g.float().norm() for g in grads]).norm() if grads else torch.tensor(0.0)
        if not torch.isfinite(total):
            for p in params.values():
                p.grad = None
            self.skipped_steps += 1
            log.warning("aegis_llm: non-finite gradient norm at step %d; step skipped", step)
            return
        for name in self.frozen:  # frozen projections must not carry a gradient
            if params[name].grad is not None:
                raise RuntimeError(f"aegis_llm: frozen attention parameter {name} received a gradient")
        for name, rule in self.rules.items():
            p = params[name]
            if p.grad is None:
                continue
            bf16 = p.grad.dtype == torch.bfloat16 and rule.group in ("mlp", "norm")
            flooded = flood(
                p.grad,
                lam=rule.lam * (self.config.bf16_scale if bf16 else 1.0),
                rho=rule.rho,
                rows=rule.rows,
                generator=self._generator_for(p.grad.device, self.generator),
                active_rel_tol=self.config.active_rel_tol,
            )[0]
            p.grad.copy_(flooded)


DEFENSES.register(
    "aegis_llm",
    AegisLLM,
    config_cls=AegisLLMConfig,
    summary="AEGIS (paper 002): freeze attention, flood embedding/MLP/norm/untied-head gradients",
    modality="text",
)

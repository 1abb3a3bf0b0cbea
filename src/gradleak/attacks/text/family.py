"""Architecture specs and the span machinery shared by the analytical text attacks.

DAGER (Petrov et al., NeurIPS 2024, Sec. 3) and paper 002 (Sec. III-C, IV-D) rest on one identity: a linear
layer y = W x applied to the rows x_1..x_n of a batch has gradient dL/dW = sum_t delta_t x_t^T, so when
n < d its input-side space is spanned by the layer's inputs. An SVD of the gradient gives a basis of that
span (rank = the number of singular values above ``rank_tol`` times the largest), and a candidate input z
belongs to the batch iff its relative residual ||z - P z|| / ||z|| is ~0.

The family map (:mod:`gradleak.models.families`, one per HF ``model_type``, shared with the defenses) says
which modules of block ``i`` feed on the block input (attention Q/K/V projections, the first MLP
projection), whether weights are stored (in, out) (HF ``Conv1D`` in GPT-2) or (out, in) (``nn.Linear``),
how positions enter the first block (learned: the layer-1 input depends on the position; rotary: it does
not) and the default thresholds. Layer inputs are
obtained by running the attacker's copy of the model with a forward pre-hook that records the input of the
target module and stops the forward pass there (:func:`capture_input`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradleak.models.families import FAMILIES, TransformerFamily
from gradleak.types import AttackInputError, Observation

FULL_SPAN_FRACTION = 0.95


FamilySpec = TransformerFamily  # the attacks' name for a family's map (gradleak.models.families)


def family_of(model: nn.Module) -> FamilySpec:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise AttackInputError(
            f"no transformer family spec for model_type {model_type!r}; known: {FAMILIES.names()}"
        )
    return FAMILIES.create(model_type)


def with_thresholds(spec: FamilySpec, **overrides: float | None) -> FamilySpec:
    """``spec`` with the non-None threshold overrides applied."""
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(spec, **changes)


def find_module(model: nn.Module, suffix: str) -> tuple[str, nn.Module]:
    """The unique module whose dotted name ends with ``suffix`` at a name boundary."""
    hits = [(n, m) for n, m in model.named_modules() if n == suffix or n.endswith("." + suffix)]
    if len(hits) != 1:
        raise AttackInputError(f"expected one module named *{suffix}, found {[n for n, _ in hits]}")
    return hits[0]


def lora_weights(names: Iterable[str], module_name: str, which: str) -> list[str]:
    """The names among ``names`` (a model's parameters, an update's tensors) of the LoRA ``which``
    (``"A"``/``"B"``) weights on module ``module_name`` (peft: ``<module>.lora_<which>.<adapter>.weight``)."""
    prefix = f"{module_name}.lora_{which}."
    return [n for n in names if n.startswith(prefix) and n.endswith(".weight")]


def update_tensor(obs: Observation, param: str) -> torch.Tensor:
    """The update's tensor for ``param`` as a gradient direction (FedAvg deltas are negated)."""
    t = obs.update.tensors.get(param)
    if t is None:
        raise AttackInputError(f"the update does not carry {param!r}, which this attack reads")
    t = t.detach().to(torch.float64)
    return t * obs.update.gradient_sign  # FedAvg deltas negated (exact: a sign flip)


def at_midpoint(model: nn.Module, obs: Observation) -> nn.Module:
    """``model`` (the attacker's copy at w_0) moved, in place, to the midpoint w_0 + delta / 2 of a FedAvg
    delta's path, where the mean gradient of the client's local steps is best read (DAGER Sec. 6, FedAvg);
    unchanged for a FedSGD gradient. Returns ``model``."""
    if obs.update.kind == "delta":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in obs.update.tensors:
                    p.add_(obs.update.tensors[name].to(p), alpha=0.5)
    return model


# A span's gradient matrix: its weights and whether each is transposed (:func:`input_side_layout`)
Layout = tuple[tuple[str, bool], ...]


def input_side_layout(model: nn.Module, suffixes: tuple[str, ...], layer: int) -> Layout:
    """The weights of ``suffixes`` in block ``layer`` and whether each is transposed so that its gradient's
    columns are input-side (nn.Linear's (out, in) weights are; GPT-2's Conv1D (in, out) ones are not)."""
    conv1d = family_of(model).conv1d
    return tuple((f"{find_module(model, s.format(i=layer))[0]}.weight", not conv1d) for s in suffixes)


def input_side_matrix(grads: Mapping[str, torch.Tensor], layout: Layout) -> torch.Tensor:
    """The (d_in, k) matrix of ``grads`` side by side in ``layout`` (:func:`input_side_layout`)."""
    return torch.cat([grads[n].T if transpose else grads[n] for n, transpose in layout], dim=1)


def input_side_gradient(
    obs: Observation, model: nn.Module, suffixes: tuple[str, ...], layer: int
) -> torch.Tensor:
    """(d_in, k) matrix whose column space is the span of the inputs of ``suffixes`` in block ``layer``."""
    layout = input_side_layout(model, suffixes, layer)
    return input_side_matrix({n: update_tensor(obs, n) for n, _ in layout}, layout)


@dataclass(frozen=True)
class Span:
    """An orthonormal basis (d, r) of the estimated input span and the singular values it came from."""

    basis: torch.Tensor
    singular_values: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    @property
    def full(self) -> bool:
        """True when the span fills (nearly) the whole input space: the check cannot discriminate."""
        return self.rank >= FULL_SPAN_FRACTION * self.basis.shape[0]

    def residual_squared32(self, z: torch.Tensor) -> torch.Tensor:
        """Approximate squared relative residual in float32 (accurate to ~1e-6): for ranking and screens."""
        z32 = z.to(torch.float32)
        proj = (z32 @ self.basis.to(torch.float32)).pow(2).sum(-1)
        return 1 - proj / z32.pow(2).sum(-1).clamp_min(1e-30)

    def below(self, z: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices of the rows of ``z`` (n, d) with residual < ``threshold``, and their residuals.

        A float32 screen (r^2 = 1 - ||B^T z||^2 / ||z||^2, one matmul) keeps the rows with r < 10 x the
        threshold (plus float32 slack); only those get the exact float64 residual.
        """
        keep = torch.nonzero(self.residual_squared32(z) < (10 * threshold) ** 2 + 1e-5).flatten()
        res = self.residual(z[keep])
        ok = res < threshold
        return keep[ok], res[ok]

    @functools.cached_property
    def complement(self) -> torch.Tensor:
        """An orthonormal basis (d, d - r) of the span's orthogonal complement (float64)."""
        basis = self.basis.to(torch.float64)
        q, _ = torch.linalg.qr(basis, mode="complete")
        return q[:, basis.shape[1] :]

    @functools.cached_property
    def _route(self) -> tuple[torch.Tensor, bool]:
        """The residual's route (float64): the complement's basis where d - r < 2 r (one product of d - r
        columns), else the span's own (two products of r columns); and whether it is the complement."""
        d, r = self.basis.shape
        complement = d - r < 2 * r
        return (self.complement if complement else self.basis.to(torch.float64)), complement

    @functools.cached_property
    def _route32(self) -> tuple[torch.Tensor, bool]:
        route, complement = self._route
        return route.to(torch.float32), complement

    def residual32(self, z: torch.Tensor) -> torch.Tensor:
        """:meth:`residual` in float32 (absolute error ~1e-6; about twice as fast): for screens that only
        rank candidates, never for a pass/fail test. A subclass that measures its residual otherwise (a
        projected space, a noise-aware bound) gets its own :meth:`residual`: no float32 shortcut."""
        if type(self).residual is not Span.residual:
            return self.residual(z)
        return _relative_residual(z.to(torch.float32), *self._route32)

    def residual(self, z: torch.Tensor) -> torch.Tensor:
        """Relative distance ||z - P z|| / ||z|| of each row of ``z`` (..., d) to the span: the norm of z's
        coordinates in the orthogonal complement (one product of d - r columns) where that is the cheaper
        route (d - r < 2 r, e.g. an encoder batch's span), else z - B B^T z (two products of r columns)."""
        return _relative_residual(z.to(torch.float64), *self._route)


def _relative_residual(z: torch.Tensor, route: torch.Tensor, complement: bool) -> torch.Tensor:
    """||z - P z|| / ||z|| per row: the norm of z's coordinates in the complement's basis ``route``
    (``complement``), else of z minus its projection on the span's basis ``route``."""
    out = z @ route if complement else z - (z @ route) @ route.T
    return out.norm(dim=-1) / z.norm(dim=-1).clamp_min(1e-30)


@dataclass(frozen=True)
class ProjectedSpan(Span):
    """A span in a projected space: ``z`` is tested as ``P z`` (``projection`` (k, d), e.g. a LoRA layer's
    ``A``) against the orthonormal ``coords`` (k, r) of the span there. ``basis`` is ``P^T coords`` (d, r),
    so ``z @ basis`` gives ``P z``'s span coordinates as for a plain :class:`Span`; the residuals are
    measured in the projected space, relative to ``||P z||``."""

    projection: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    coords: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))

    @classmethod
    def of(cls, span: Span, projection: torch.Tensor) -> ProjectedSpan:
        p = projection.to(torch.float64)
        return cls(p.T @ span.basis, span.singular_values, p, span.basis)

    @property
    def full(self) -> bool:
        return self.rank >= FULL_SPAN_FRACTION * self.coords.shape[0]

    def residual_squared32(self, z: torch.Tensor) -> torch.Tensor:
        pz = z.to(torch.float32) @ self.projection.T.to(torch.float32)
        proj = (pz @ self.coords.to(torch.float32)).pow(2).sum(-1)
        return 1 - proj / pz.pow(2).sum(-1).clamp_min(1e-30)

    def residual(self, z: torch.Tensor) -> torch.Tensor:
        pz = z.to(torch.float64) @ self.projection.T
        inside = (pz @ self.coords) @ self.coords.T
        return (pz - inside).norm(dim=-1) / pz.norm(dim=-1).clamp_min(1e-30)


def estimate_span(
    grad: torch.Tensor, rank_tol: float, max_rank: int | None = None, min_gap: float = 10.0
) -> Span:
    """SVD of the input-side gradient and a rank estimate (DAGER Sec. 4.1).

    The rank is after the last sharp drop of the spectrum: r = 1 + the largest i with
    s_i / s_(i+1) >= ``min_gap`` among the singular values with s_i >= ``rank_tol`` * s_0 (a floor below
    which float32 rounding noise lives), capped at ``max_rank``. The *last* drop, not the largest: one
    dominant token (BERT's [CLS] under a classification loss) makes an earlier, larger drop inside the
    signal. A spectrum that never drops by ``min_gap`` (a full-rank gradient: more tokens than the width,
    or noise) gives every value above the floor, i.e. no low-rank structure.
    """
    u, s, _ = torch.linalg.svd(grad.to(torch.float64), full_matrices=False)
    if s.numel() == 0 or float(s[0]) == 0.0:
        return Span(u[:, :0], s)
    n = int((s >= rank_tol * s[0]).sum())
    m = min(n, s.numel() - 1)  # ratios s_i / s_(i+1) for i < m
    ratios = s[:m] / s[1 : m + 1].clamp_min(1e-300)
    drops = torch.nonzero(ratios >= min_gap).flatten()
    r = int(drops[-1]) + 1 if drops.numel() else n
    if max_rank is not None:
        r = min(r, max_rank)
    return Span(u[:, :r], s)


class _Stop(Exception):
    pass


@torch.no_grad()
def capture_input(model: nn.Module, module: nn.Module, **forward: Any) -> torch.Tensor:
    """Run ``model(**forward)`` up to ``module`` and return the module's first input."""
    box: list[torch.Tensor] = []

    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        box.append(args[0] if args else kwargs["hidden_states"])
        raise _Stop

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(**forward)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not box:
        raise AttackInputError(f"the forward pass never reached {type(module).__name__}")
    return box[0].detach()


def layer_inputs(
    model: nn.Module, module: nn.Module, ids: torch.Tensor, *, start_position: int = 0, chunk: int = 4096
) -> torch.Tensor:
    """Inputs (n, T, d) of ``module`` for token sequences ``ids`` (n, T) starting at ``start_position``."""
    spec = family_of(model)
    outs = []
    t = ids.shape[1]
    pos = torch.arange(start_position, start_position + t).unsqueeze(0)
    for part in ids.split(chunk):
        kw: dict[str, Any] = {"input_ids": part, "position_ids": pos.expand(part.shape[0], t)}
        if spec.token_types:
            kw["token_type_ids"] = torch.zeros_like(part)
        if spec.causal:
            kw["use_cache"] = False
        outs.append(capture_input(model, module, **kw))
    return torch.cat(outs)


def input_embedding(model: nn.Module) -> nn.Embedding:
    """The model's input token embedding (``AttackInputError`` where it exposes none)."""
    getter: Any = getattr(model, "get_input_embeddings", None)
    emb = getter() if getter is not None else None
    if not isinstance(emb, nn.Embedding):
        raise AttackInputError("the model exposes no input token embedding")
    return emb


def vocab_size(model: nn.Module) -> int:
    return int(input_embedding(model).num_embeddings)


def embedding_param(model: nn.Module) -> str:
    name, _ = find_module(model, family_of(model).embedding)
    return f"{name}.weight"

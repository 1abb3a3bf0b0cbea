"""UTR on bottleneck adapters: DAGER's span test on the adapters' down-projection gradients.

UTR ("Gradient Inversion Attack for Adapter-based Federated Large Language Models", arXiv 2601.17533; code
github.com/shwksnshwowk-wq/GIA) attacks federated fine-tuning where the backbone is frozen and only
bottleneck adapters (and the head) train: an adapter after the embeddings and after the blocks
(:mod:`gradleak.models.adapters`, ``kind = "bottleneck"``: here one on every block's input). An adapter's
down-projection ``W_down`` (r x d, bias ``b_down``) sees the block's input ``x_t`` at every token, so

    dL/dW_down = sum_t g_t x_t^T,     dL/db_down = sum_t g_t,     g_t = relu'(W_down x_t + b_down) * u_t,

``u_t = W_up^T dL/dh_t`` (times the output ReLU's derivative in the non-residual form), and the rows of
``dL/dW_down`` lie in the span of the ``x_t``. The official code divides each row by its bias gradient
(``dL/dW_j / dL/db_j``, an affine combination of the ``x_t``; rows whose bias gradient is zero dropped) and
tests candidates with a least-squares fit to those rows; a row's scale does not change the span, so here
the span is estimated from the gradient's singular vectors as DAGER's is (Petrov et al., NeurIPS 2024,
Sec. 4), and DAGER's pipeline runs with the adapters' down projections in place of the attention
projections:

1. **Token presence** (UTR's first stage): the first adapter reads the embeddings, so a vocabulary token
   (at a position, for learned positions) is present iff its embedding lies in the span of the first
   adapter's gradient (:meth:`Dager.position_candidates`).
2. **Sequences** (UTR's second stage): the second adapter reads block 0's outputs, so a candidate sequence
   is kept iff its block-0 outputs lie in that adapter's span (DAGER's decoder search for a causal model,
   its encoder search otherwise).

What it needs (its threat model): an honest-but-curious server that sees one client's adapter update
(FedSGD, as UTR's code; ``utr_fedavg`` for a FedAvg delta); adapters on the first two
blocks' inputs; ``r`` above the batch's distinct (token, position) count, since the span has rank at most
``r`` (UTR's scripts use ``r = d / 2``: a span whose rank fills the gradient's ``r`` live columns is a
subspace of the inputs', and nothing is read); a causal model's last token is only a label and is not read (an
adapter update carries no LM head gradient to complete it); no dropout on the adapters' inputs in the
client's training mode (the candidates' inputs are computed without it). Units that no token activates
(dead ReLUs) give zero rows, which are dropped before the span is estimated.

**FedAvg** (``utr_fedavg``; UTR's code computes one gradient). A delta ``w_T - w_0`` of adapters whose
weights are ``N(0, 0.01^2)`` (the residual form) loses digits to float32 cancellation: at one SGD step of
lr 1e-3 on the GPT-2 arch the noise fills the span (rank 32 of 32) and exact DAGER's thresholds (1e-3) keep
nothing. The first
adapter's inputs (the embeddings) never move, the second's move with the first adapter, so as in
``dager_fedavg`` the candidates of several steps are evaluated at the midpoint weights ``w_0 + delta / 2``
(one plain SGD step is the gradient at ``w_0`` times ``-lr``: read at ``w_0``), the spectrum is cut at
``1e-4`` of its top value, and both span tests accept a relative residual of 0.03 (chosen on that test:
1 and 3 steps).

**Noise** (``utr_spectral``, adaptive): told the defense's noise scale (a DP configuration is public;
``dager_spectral``'s module docstring), the spans are the singular directions above the noise's bulk edge
and each candidate is tested against its first-order residual bound: ``dager_spectral``'s tests on the
adapters' spans.

**Pruning** (``utr_masked``, adaptive): told that the zeros it receives are dropped entries, it completes
each adapter gradient to the lowest rank that fits the kept entries first (``dager_masked``'s completion),
where the kept entries outnumber that rank's degrees of freedom ``k (d + r - k)``.

Where the official code differs, read not copied:
- its sentence stage (``GPT_process_combinations_without_modeltest_csv_opt``) tests the prefixes of each
  *true* sentence (``True_input_ids``) against the second adapter's span, and scores only the sentences
  that pass. That verifies the batch rather than searching for it; here the search starts from the token
  candidates alone;
- its BERT scripts filter candidates by a CoLA acceptability classifier (``Abiratebert_fine_tuned_cola``, not
  available offline); its GPT-2 scripts load it and do not use it. No such filter is used here;
- its adapters are not residual; both forms are built (``residual``), and the test is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from gradleak.attacks.noise import noise_scale
from gradleak.attacks.text.dager.core import Dager, DagerConfig, DecoderSearch
from gradleak.attacks.text.dager.lora import one_sgd_step
from gradleak.attacks.text.dager.masked import DagerMasked, DagerMaskedConfig
from gradleak.attacks.text.dager.spectral import DagerSpectral, DagerSpectralConfig
from gradleak.attacks.text.family import FamilySpec, Span, find_module, update_tensor
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation

ADAPTER_DOWN = "{block}.bottleneck.down"  # a block's bottleneck adapter's down projection (models/adapters)


@dataclass(frozen=True)
class UTRConfig(DagerConfig):
    """DAGER's options; the decoder's last-token completion and prefix sentences off (they read the LM
    head's gradient, which an adapter update does not carry)."""

    decoder: DecoderSearch = field(
        default_factory=lambda: DecoderSearch(complete_last_token=False, prefix_sentences=False)
    )


@dataclass(frozen=True)
class UTRFedAvgConfig(UTRConfig):
    """UTR on a FedAvg delta (module docstring, "FedAvg"): midpoint weights, the spectrum cut at 1e-4 of
    its top value, both span tests at a relative residual of 0.03."""

    l1_threshold: float | None = 0.03
    l2_threshold: float | None = 0.03
    rank_tol: float | None = 1e-4
    midpoint_weights: bool = True


class UTR(Dager):
    """DAGER whose spans come from the bottleneck adapters' down projections (module docstring)."""

    zero_gradient = (
        "the first bottleneck adapter's down-projection gradient is zero (its up projection is zero, "
        "or the adapter did not train)"
    )

    config: UTRConfig
    peelable = False  # its spans are the adapters' (peeling is measured on DAGER's own spans only)

    def __init__(self, config: UTRConfig | None = None) -> None:
        super().__init__(config or UTRConfig())

    def spec(self, model: nn.Module) -> FamilySpec:
        spec = super().spec(model)
        template = ADAPTER_DOWN.format(block=spec.block)
        for i in (0, 1):
            try:
                if not spec.block:  # a family without a block template has no bottleneck adapters
                    raise AttackInputError("no block template")
                find_module(model, template.format(i=i))
            except AttackInputError:
                raise AttackInputError(
                    f"utr reads bottleneck adapters on the first two blocks' inputs (model.adapter = "
                    f"{{kind = 'bottleneck'}}); this {spec.model_type} model has none on block {i}"
                ) from None
        return replace(spec, attn_inputs=(template,))

    def input_gradient(
        self, obs: Observation, model: nn.Module, spec: FamilySpec, layer: int
    ) -> torch.Tensor:
        """Block ``layer``'s adapter down-projection gradient, transposed (d, r'), its all-zero columns
        (units no token activates) dropped: its columns span the block's inputs."""
        name, _ = find_module(model, spec.attn_inputs[0].format(i=layer))
        grad = update_tensor(obs, f"{name}.weight").T  # nn.Linear stores (out, in)
        live = grad.abs().amax(dim=0) > 0
        return grad[:, live] if bool(live.any()) else grad

    def saturated(self, span: Span, grad: torch.Tensor) -> bool:
        """A span whose rank fills the gradient's live columns (the adapter's width ``r``) is a subspace of
        the inputs' span, not that span: nothing is read (module docstring)."""
        return span.rank >= min(grad.shape)

    def complete(
        self, obs: Observation, model: nn.Module, spec: FamilySpec, seqs: list[list[int]], batch: int
    ) -> tuple[list[list[int]], int]:
        """The sequences as found: an adapter update carries no LM head gradient to read last tokens from."""
        return seqs, 0


class UTRFedAvg(UTR):
    """UTR on a FedAvg delta (module docstring, "FedAvg")."""

    def __init__(self, config: UTRFedAvgConfig | None = None) -> None:
        super().__init__(config or UTRFedAvgConfig())

    def attacker_model(self, obs: Observation) -> nn.Module:
        """The midpoint weights for several local steps, the broadcast ones for one plain SGD step."""
        return obs.client_model() if one_sgd_step(obs) else super().attacker_model(obs)


@dataclass(frozen=True)
class UTRSpectralConfig(UTRConfig, DagerSpectralConfig):
    """``dager_spectral``'s options (what the attack knows of the noise) with UTR's decoder defaults."""


class UTRSpectral(UTR, DagerSpectral):
    """UTR whose span tests know the noise scale (module docstring, "Noise"): UTR's spans, DAGER-spectral's
    tests."""

    config: UTRSpectralConfig

    def __init__(self, config: UTRSpectralConfig | None = None) -> None:
        super().__init__(config or UTRSpectralConfig())

    def noise_std(self, obs: Observation) -> float:
        return noise_scale(obs.update, self.config.noise_std, "utr_spectral")


@dataclass(frozen=True)
class UTRMaskedConfig(UTRConfig, DagerMaskedConfig):
    """``dager_masked``'s options (the completion) with UTR's decoder defaults."""


class UTRMasked(UTR, DagerMasked):
    """UTR whose spans come from a low-rank completion of pruned adapter gradients (module docstring,
    "Pruning"): UTR's gradients, DAGER-masked's completion."""

    config: UTRMaskedConfig

    def __init__(self, config: UTRMaskedConfig | None = None) -> None:
        super().__init__(config or UTRMaskedConfig())


ATTACKS.register(
    "utr",
    UTR,
    config_cls=UTRConfig,
    summary="UTR on bottleneck adapters: DAGER's span test on the adapters' down projections (r >= tokens)",
    modality="text",
)

ATTACKS.register(
    "utr_fedavg",
    UTRFedAvg,
    config_cls=UTRFedAvgConfig,
    summary="UTR on a FedAvg delta of bottleneck adapters: midpoint weights, relaxed thresholds",
    modality="text",
)

ATTACKS.register(
    "utr_spectral",
    UTRSpectral,
    config_cls=UTRSpectralConfig,
    summary="UTR knowing the noise scale: adapter spans above the noise bulk edge (adaptive, vs DP noise)",
    modality="text",
)

ATTACKS.register(
    "utr_masked",
    UTRMasked,
    config_cls=UTRMaskedConfig,
    summary="UTR knowing the update was pruned: low-rank completion of the adapter gradients (adaptive)",
    modality="text",
)

__all__ = [
    "UTR",
    "UTRConfig",
    "UTRFedAvg",
    "UTRFedAvgConfig",
    "UTRMasked",
    "UTRMaskedConfig",
    "UTRSpectral",
    "UTRSpectralConfig",
]

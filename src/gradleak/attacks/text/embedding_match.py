"""TAG and LAMP: text from a FedSGD gradient by optimising the input embeddings.

Both attacks treat the B sequences as continuous embeddings ``x`` of shape ``(B, T, d)``, feed them to the
attacker's copy of the model (``inputs_embeds``, in the client's mode), take the client's loss (the task
loss, :data:`TASK_LOSSES`), and move ``x`` so that the gradient of that loss matches the observed update;
each position is then read back as the vocabulary token whose embedding is closest in cosine.

The task loss:

- **classification** (the setting of both papers: BERT fine-tuned on a sentence task): cross-entropy at
  the granted labels.
- **causal_lm** (paper 002 runs TAG and LAMP on GPT-2 under the next-token loss, Table XIII; neither
  paper's code models it): the labels are the sequence's own next tokens, so they move with ``x``. Here
  the target of position t is the softmax over the candidate vocabulary of the cosine similarities of
  ``x[t+1]`` to the token embeddings at ``temperature`` (ours: 0.05), the loss the mean soft cross-entropy
  over the B (T - 1) positions (the transformers causal-LM loss when the targets are one-hot): at the true
  embeddings the targets are (nearly) the true tokens, and away from them the labels pull ``x`` too,
  which a hard nearest-token label would not.

- **TAG** (Deng et al., Findings of EMNLP 2021, Sec. 3): the distance is the squared L2 norm plus
  ``l1_weight`` times the L1 norm of the gradient difference, summed over the parameters; Adam from one
  random start. Defaults from the baseline script of LAMP's official code (eth-sri/lamp, ``tag.sh``:
  lr 0.1, no decay, ``tag_factor`` 0.01, 2,500 steps), which is where TAG's public implementation lives.
- **LAMP** (Balunović et al., NeurIPS 2022, Alg. 1, the ``lamp_cos`` variant): the distance is the mean
  per-parameter cosine distance, plus ``norm_weight`` times the squared gap between the mean embedding
  norm and ``init_norm`` (Eq. 5); the start is the best of ``init_candidates`` random draws by that
  distance, then the best of as many permutations of it; Adam with lr 0.01 decayed by 0.89 every 50 steps;
  every ``swap_every`` steps after the first ``swap_burnin`` share, discrete moves of each sequence's
  tokens (swap two, move one, move a span, rotate a prefix: 200 tries a sequence) are kept when they lower
  the objective (``lamp_cos.sh``: 2,000 steps, ``coeff_reg`` 1, ``init_size`` 1.4, ``swap_every`` 75,
  ``swap_burnin`` 0.1). LAMP scores the moves with a language model's perplexity beside the distance
  (``coeff_perplexity`` 0.2, a GPT-2 with BERT's vocabulary trained on WikiText-103 in the official code):
  here ``prior`` trains such a model, smaller, on a public split with the victim's tokenizer
  (:mod:`~gradleak.attacks.text.lm_prior`; ``prior.tokenizer`` names it, e.g. ``"minilm"``). Without one
  (the default: the attack cannot tell the victim's tokenizer from its weights) the moves are scored by the
  distance alone, LAMP's ablation without the prior.

What the attacker must know or read (the official code's defaults, LAMP's threat model):

- B is the update's sample count; T, the longest sequence, is read from the learned position embedding's
  gradient (the last position with a non-zero row: no gradient reaches a position no sequence holds), or,
  for rotary positions (Llama, SmolLM2), from the rank of block 2's attention-input gradient (DAGER's L2
  span, :func:`~gradleak.attacks.text.family.estimate_span`): rotary positions enter block 1's attention
  after its projections, so block 1's inputs are the tokens' alone (a repeated token adds no rank), while
  block 2's input of each position carries its position and context, so T = rank / B rounded up; under
  the next-token loss the last position of a causal LM is only a label (no gradient reaches its input), so
  T is one more there. T is at most the width of the
  observation's input shape (the recipe's token limit, public), and is that width where the gradient does
  not show it (a flooded or missing position gradient, frozen attention, a null update; ``length_read`` 0
  in the stats). All sequences are taken to be T long (LAMP's ``know_padding`` off): a shorter one comes
  back with guesses in its padding.
- The vocabulary is the rows of the word-embedding gradient that are not zero (LAMP's ``use_embedding``,
  paper 002's channel 2) where the update carries it. A tied LM head makes every row non-zero; then the
  rows the row-norm channel keeps (:func:`~gradleak.attacks.text.rownorm.select_rows`). Without the
  embedding gradient, the whole vocabulary.
- Classification labels: the granted ones (``audit.grant_labels``, LAMP's threat model); else read off
  the classification head's bias gradient (:func:`classifier_labels`: iDLG's sign for B = 1, exact;
  LLG-style counts for B > 1: the multiset, whose order the optimisation assigns where the sequences are
  interchangeable). Refused before work: a head without a bias in the update, and recovered labels of
  more than one class with granted unequal lengths (each slot then has its own length, and which label
  goes with which length is not known: grant the labels too, as LAMP's threat model does).

A model with neither a classification head nor a language-model head is refused before work.

**FedAvg** (neither paper's setting; the reading ``dlg`` and ``dager_fedavg`` make): a delta of K plain SGD
steps at learning rate lr is -lr times the sum of the gradients along the client's path, so
(w_0 - w_T) / (lr K), from the public recipe, is their mean, which the attacker's copy reproduces best at
the path's midpoint w_0 + delta / 2 (``midpoint_weights``, DAGER Sec. 6). Exact for one step on one batch;
the more the weights move, the further the mean is from any one gradient. A hidden recipe, or an optimiser
whose delta is not a multiple of the gradients (Adam, momentum, weight decay), is refused before work.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from gradleak.attacks.image.dlg import gradient_target
from gradleak.attacks.image.labels import last_linear, recover_label_counts, recover_labels
from gradleak.attacks.text.family import (
    at_midpoint,
    embedding_param,
    estimate_span,
    family_of,
    input_embedding,
    input_side_gradient,
    update_tensor,
    vocab_size,
)
from gradleak.attacks.text.lm_prior import LMPriorConfig, load_prior, vocabulary_size
from gradleak.attacks.text.rownorm import RowNormConfig, select_rows
from gradleak.progress import bar
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, AttackNeeds, Observation, Reconstruction

log = logging.getLogger(__name__)

DISTANCES = ("l2_l1", "cosine")  # the names of DISTANCE_OF, checked on construction


@dataclass(frozen=True)
class EmbeddingMatchConfig:
    """Options of TAG and LAMP (module docstring; the defaults are TAG's, :class:`LampConfig` LAMP's)."""

    distance: str = "l2_l1"  # "l2_l1" (TAG) or "cosine" (LAMP)
    steps: int = 2500
    lr: float = 0.1
    lr_decay: float = 1.0  # StepLR's gamma every 50 steps
    l1_weight: float = 0.01  # TAG's alpha (tag_factor)
    norm_weight: float = 0.0  # LAMP's coeff_reg: (mean ||x|| - init_norm)^2
    init_norm: float | None = None  # None: the mean norm of the vocabulary's embeddings (BERT-base: ~1.4)
    init_candidates: int = 1  # random starts scored by the distance (LAMP: 500)
    swap_every: int = 0  # LAMP's discrete moves every so many steps (0: none)
    swap_burnin: float = 0.1  # ... after this share of the steps
    swap_tries: int = 200  # moves tried per sequence
    prior_weight: float = 0.0  # LAMP's coeff_perplexity: the weight of ``prior``'s loss in the moves
    prior: LMPriorConfig = field(default_factory=LMPriorConfig)  # tokenizer None: no prior
    vocab: str = "embedding"  # "embedding": the embedding gradient's non-zero rows; "full"
    grad_clip: float | None = None
    temperature: float = 0.05  # causal LMs: the soft next-token targets' softmax temperature (ours)
    midpoint_weights: bool = True  # a FedAvg delta: the attacker's copy at w_0 + delta / 2 (module docstring)
    first_token_id: int | None = None  # every sequence starts with it (BERT's [CLS], 101): pinned at 0
    last_token_id: int | None = None  # every sequence ends with it (BERT's [SEP], 102): pinned at its end

    def __post_init__(self) -> None:
        if self.distance not in DISTANCES:
            raise ValueError(f"distance must be one of {DISTANCES}, got {self.distance!r}")
        if self.vocab not in ("embedding", "full"):
            raise ValueError(f"vocab must be 'embedding' or 'full', got {self.vocab!r}")
        for key in ("steps", "init_candidates"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"{key} must be an int >= 1, got {getattr(self, key)!r}")
        if self.swap_every < 0 or self.swap_tries < 1 or not 0 <= self.swap_burnin < 1:
            raise ValueError("need swap_every >= 0, swap_tries >= 1 and swap_burnin in [0, 1)")
        if self.lr <= 0 or not 0 < self.lr_decay <= 1 or self.l1_weight < 0 or self.norm_weight < 0:
            raise ValueError("need lr > 0, lr_decay in (0, 1], l1_weight >= 0, norm_weight >= 0")
        if not 0 <= self.prior_weight < float("inf"):
            raise ValueError(f"prior_weight must be a finite number >= 0, got {self.prior_weight}")
        if not isinstance(self.prior, LMPriorConfig):
            raise TypeError(f"prior must be an LMPriorConfig, got {type(self.prior).__name__}")
        if self.prior.tokenizer is not None and (self.prior_weight == 0 or self.swap_every == 0):
            raise ValueError(
                "prior.tokenizer names a language-model prior, which scores LAMP's discrete moves: it needs "
                f"prior_weight > 0 and swap_every > 0 (got {self.prior_weight} and {self.swap_every})"
            )
        if self.init_norm is not None and self.init_norm <= 0:
            raise ValueError(f"init_norm must be > 0, got {self.init_norm}")
        if not 0 < self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        for key in ("first_token_id", "last_token_id"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{key} must be a token id (an int >= 0) or None, got {value!r}")


@dataclass(frozen=True)
class LampConfig(EmbeddingMatchConfig):
    """LAMP's defaults (``lamp_cos.sh`` of eth-sri/lamp)."""

    distance: str = "cosine"
    steps: int = 2000
    lr: float = 0.01
    lr_decay: float = 0.89
    norm_weight: float = 1.0
    init_norm: float | None = None  # the vocabulary's mean norm (the official 1.4 is BERT-base's)
    init_candidates: int = 500
    swap_every: int = 75
    prior_weight: float = 0.2  # coeff_perplexity; applies once ``prior.tokenizer`` names one


Distance = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
PriorTerm = Callable[
    [torch.Tensor, list[torch.Tensor]], torch.Tensor
]  # (sequence, moves) -> each move's term


def l2_l1(grads: list[torch.Tensor], target: list[torch.Tensor], l1_weight: float) -> torch.Tensor:
    """TAG's distance: sum over parameters of ||g - t||^2 + alpha ||g - t||_1."""
    total = grads[0].new_zeros(())
    for g, t in zip(grads, target, strict=True):
        d = g - t
        total = total + d.square().sum() + l1_weight * d.abs().sum()
    return total


SILENT = 1e-7  # a target this small relative to the largest is rounding of a structural zero (mean_cosine)


def mean_cosine(grads: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
    """LAMP's distance: the mean over parameters of 1 - cos(g, t). A parameter whose target is below
    :data:`SILENT` times the largest target's norm is left out: it is float rounding of a gradient that is
    zero by construction (BERT's key biases: the softmax ignores a shift shared by every key; 1.6e-12
    measured), and its cosine with the attacker's own rounding is noise (each such parameter added a term
    anywhere in [0, 2], 1 / 40 of it on the 2-layer BERT). TAG's distance keeps them: a few 1e-12 there."""
    norms = [float(t.norm()) for t in target]
    floor = SILENT * max(norms, default=0.0)
    kept = [(g, t, n) for g, t, n in zip(grads, target, norms, strict=True) if n > floor]
    if not kept:  # an all-zero target: every term 1 - 0, kept on the graph
        return 1 + 0 * torch.stack([g.sum() for g in grads]).sum()
    total = grads[0].new_zeros(())
    for g, t, n in kept:
        total = total + 1 - (g * t).sum() / (g.norm() * n).clamp_min(1e-12)
    return total / max(1, len(kept))


# config.distance -> the distance at the config's settings
DISTANCE_OF: dict[str, Callable[[EmbeddingMatchConfig], Distance]] = {
    "l2_l1": lambda c: partial(l2_l1, l1_weight=c.l1_weight),
    "cosine": lambda c: mean_cosine,
}


class TaskLoss(Protocol):
    """The client's loss of ``inputs_embeds`` ``x`` on the attacker's copy; ``labels`` the classification
    labels it uses (granted), None where the labels are the sequence itself."""

    @property
    def labels(self) -> torch.Tensor | None: ...

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor: ...


def _attention(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The attention mask of ``x`` (B, T, d): ``mask`` (granted lengths), else every position real."""
    if mask is None:
        return torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
    return mask.to(x.device)


def length_mask(lengths: tuple[int, ...] | None, width: int) -> torch.Tensor | None:
    """(B, ``width``) 1 on each sequence's first ``lengths[b]`` positions (right padding), or None."""
    if lengths is None:
        return None
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()


@dataclass(frozen=True)
class ClassificationLoss:
    """Cross-entropy at the granted labels (TAG's and LAMP's setting); ``mask`` the padding of granted
    lengths (None: every position real)."""

    labels: torch.Tensor
    mask: torch.Tensor | None = None

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        attention = _attention(x, self.mask)
        loss: torch.Tensor = model(inputs_embeds=x, attention_mask=attention, labels=self.labels).loss
        return loss


@dataclass(frozen=True)
class SoftNextTokenLoss:
    """The next-token loss with soft labels read off ``x`` itself (module docstring): the target of position
    t is softmax over ``vocab`` of cos(x[t+1], E_v) / ``temperature``; the loss is the mean over the
    B (T - 1) predicted positions of -sum_v q_v log p_v; with ``mask`` (granted lengths) over the positions
    whose next one is real, as the client's loss leaves padded labels out."""

    table: torch.Tensor  # the candidate tokens' embeddings, unit rows (|vocab|, d)
    vocab: torch.Tensor
    temperature: float
    labels: torch.Tensor | None = None  # the labels are the sequence's own next tokens
    mask: torch.Tensor | None = None

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        attention = _attention(x, self.mask)
        logits = model(inputs_embeds=x, attention_mask=attention).logits[:, :-1]
        logp = torch.log_softmax(logits.to(x.dtype), dim=-1)[..., self.vocab.to(x.device)]
        q = torch.softmax(F.normalize(x[:, 1:], dim=-1) @ self.table.to(x).T / self.temperature, dim=-1)
        nll = -(q * logp).sum(-1)
        if self.mask is None:
            return nll.mean()
        predicted = attention[:, 1:].to(nll.dtype)
        return (nll * predicted).sum() / predicted.sum()


def task_of(model: nn.Module) -> str:
    """``"classification"`` (a classification head), ``"causal_lm"`` (a causal LM head), else refused."""
    spec = family_of(model)
    head = spec.heads.get("classification")
    if head is not None and any(n.endswith(head) for n, _ in model.named_modules()):
        return "classification"
    output_embeddings = getattr(model, "get_output_embeddings", None)
    if spec.causal and callable(output_embeddings) and output_embeddings() is not None:
        return "causal_lm"
    raise AttackInputError(
        f"{spec.model_type}: TAG and LAMP invert a classification model's or a causal language model's "
        "gradient; this model has neither head"
    )


def _classification(
    obs: Observation,
    table: torch.Tensor,
    vocab: torch.Tensor,
    c: EmbeddingMatchConfig,
    mask: torch.Tensor | None,
) -> TaskLoss:
    return ClassificationLoss(classifier_labels(obs), mask)


def classifier_labels(obs: Observation) -> torch.Tensor:
    """The batch's class labels: the granted ones, else read off the classification head's bias update
    (iDLG for one sequence, LLG-style counts for more, as the image attacks read theirs:
    :mod:`gradleak.attacks.image.labels`; a FedAvg delta through its public recipe's mean gradient). A head
    without a bias (GPT-2's and Llama's ``score``) gives no reading: refused before work."""
    n = obs.update.num_samples
    if obs.labels is not None:
        if len(obs.labels) != n:
            raise AttackInputError(f"{len(obs.labels)} labels granted for a batch of {n}")
        return obs.labels.long()
    name, head = last_linear(obs.model)
    if head.bias is None or f"{name}.bias" not in obs.update.tensors:
        raise AttackInputError(
            f"the labels are hidden and the update carries no bias of the classification head {name!r} to "
            "read them from: grant them (audit.grant_labels = true, as LAMP assumes)"
        )
    if obs.update.kind == "gradient":
        return recover_labels(obs, n)
    assert obs.training is not None  # require_sgd_reading refused a delta without its recipe
    return recover_label_counts(obs, n, lr=obs.training.lr, steps=obs.training.steps(n))


def _causal_lm(
    obs: Observation,
    table: torch.Tensor,
    vocab: torch.Tensor,
    c: EmbeddingMatchConfig,
    mask: torch.Tensor | None,
) -> TaskLoss:
    return SoftNextTokenLoss(F.normalize(table[vocab], dim=-1), vocab, c.temperature, mask=mask)


# task_of(model) -> the loss the attacker's copy takes (checked before any work): the observation, the
# embedding table, the candidate vocabulary, the options, the padding mask of granted lengths (or None)
TASK_LOSSES: dict[
    str,
    Callable[[Observation, torch.Tensor, torch.Tensor, EmbeddingMatchConfig, torch.Tensor | None], TaskLoss],
] = {
    "classification": _classification,
    "causal_lm": _causal_lm,
}


@dataclass
class Inversion:
    """One inversion problem: the attacker's model, the parameters matched, the target, the task loss.
    ``masks`` (one per parameter, None: all of it) zero what the attacker's copy cannot reproduce in both
    the target and its own gradients (:func:`tied_mask`)."""

    model: nn.Module
    params: list[nn.Parameter]
    target: list[torch.Tensor]
    loss: TaskLoss
    distance: Distance
    masks: list[torch.Tensor | None] | None = None
    lengths: tuple[int, ...] | None = None  # granted per-sequence lengths (None: all T long)
    variables: list[dict[str, Any]] = field(default_factory=list)  # further Adam groups (GRAB's masks)

    def __post_init__(self) -> None:
        if self.masks is not None:
            self.target = [t if m is None else t * m for t, m in zip(self.target, self.masks, strict=True)]

    def gradients(self, x: torch.Tensor, *, create_graph: bool) -> list[torch.Tensor]:
        loss = self.loss(self.model, x)
        grads = list(torch.autograd.grad(loss, self.params, create_graph=create_graph, allow_unused=True))
        if self.masks is None:
            return grads
        return [g if g is None or m is None else g * m for g, m in zip(grads, self.masks, strict=True)]

    def objective(self, x: torch.Tensor, *, create_graph: bool = True) -> torch.Tensor:
        grads = self.gradients(x, create_graph=create_graph)
        kept = [(g, t) for g, t in zip(grads, self.target, strict=True) if g is not None]
        return self.distance([g for g, _ in kept], [t for _, t in kept])


def sequence_length(obs: Observation, model: nn.Module) -> int | None:
    """T as the gradient shows it (module docstring), or None where it does not: one past the last learned
    position whose embedding gradient is not zero; for rotary positions the rank of block 2's attention-input
    gradient over B, rounded up. Under a causal LM's next-token loss the last position is only a label (its
    input feeds no prediction): one more."""
    spec = family_of(model)
    label_only = int(task_of(model) == "causal_lm")
    if spec.positions != "learned":
        try:  # block 2: rotary positions enter block 1's attention after its projections, not its inputs
            span = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
        except AttackInputError:  # the update does not carry block 2's attention inputs (frozen)
            return None
        if span.rank == 0 or span.full:
            return None
        return -(-span.rank // max(1, obs.update.num_samples)) + label_only
    names = [f"{n}.weight" for n, _ in model.named_modules() if n and re.search(spec.other_embeddings, n)]
    positions = [n for n in names if "position" in n or n.endswith("wpe.weight")]
    if not positions or positions[0] not in obs.update.tensors:
        return None
    used = torch.nonzero(update_tensor(obs, positions[0]).abs().sum(dim=1) > 0).flatten()
    return int(used.max()) + 1 + label_only if used.numel() else None


def require_sgd_reading(obs: Observation) -> None:
    """A FedAvg delta is matched as the mean gradient (w_0 - w_T) / (lr K) of K plain SGD steps (module
    docstring, "FedAvg"; :func:`~gradleak.attacks.image.dlg.gradient_target` computes it): refused before
    work where the recipe is hidden or not plain SGD (Adam, momentum, weight decay, same-label batches: a
    delta that is not a known multiple of gradients). A FedSGD gradient passes."""
    if obs.update.kind == "gradient":
        return
    tr = obs.training
    if tr is None:
        raise AttackInputError(
            "TAG and LAMP read a FedAvg delta as plain SGD's mean gradient (w_0 - w_T) / (lr K), from the "
            "client's public recipe (audit.training_public = true); the recipe is hidden"
        )
    if not tr.plain_sgd:
        raise AttackInputError(
            f"TAG and LAMP read a FedAvg delta as plain SGD's mean gradient; the recipe's optimizer is "
            f"{tr.optimizer!r} (momentum {tr.momentum}, weight decay {tr.weight_decay}, batching "
            f"{tr.batching!r}), whose delta is not a known multiple of the gradients"
        )


def candidate_vocab(obs: Observation, model: nn.Module, mode: str) -> torch.Tensor:
    """The token ids a position may take (module docstring): the embedding gradient's non-zero rows, or
    where all are non-zero (a tied LM head) the rows the row-norm channel keeps; else the whole
    vocabulary."""
    name = embedding_param(model)
    if mode == "embedding" and name in obs.update.tensors:
        grad = update_tensor(obs, name)
        nonzero = torch.nonzero(grad.abs().sum(dim=1) > 0).flatten()
        if 0 < nonzero.numel() < grad.shape[0]:
            return nonzero
        rows, _ = select_rows(grad, RowNormConfig())
        if rows:
            log.info("TAG/LAMP: every embedding row is non-zero; %d rows kept by the row-norm gap", len(rows))
            return torch.tensor(sorted(rows))
    log.info("TAG/LAMP: the whole vocabulary is searched")
    return torch.arange(vocab_size(model))


def tied_mask(model: nn.Module, vocab: torch.Tensor) -> torch.Tensor | None:
    """For a tied LM head, the mask of the embedding rows outside ``vocab``: the client's gradient of the
    tied matrix adds the input lookup's term on the rows of its input tokens, which an attacker feeding
    ``inputs_embeds`` does not produce, so those rows are left out of the distance (in the target and the
    attacker's gradient); elsewhere both hold the head's term alone. None for an untied head."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    table = input_embedding(model).weight
    if head is None or getattr(head, "weight", None) is not table:
        return None
    mask = torch.ones(table.shape[0], 1, dtype=table.dtype, device=table.device)
    mask[vocab.to(table.device)] = 0
    return mask


def nearest_tokens(x: torch.Tensor, table: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Per position the vocabulary token with the highest cosine similarity to ``x``."""
    emb = F.normalize(table[vocab], dim=-1)
    sims = F.normalize(x, dim=-1) @ emb.T
    return vocab[sims.argmax(dim=-1)]


def _lengths(lengths: tuple[int, ...] | None, batch: int, width: int) -> list[int]:
    """Each sequence's length: the granted ones, else ``width`` for all ``batch``."""
    return list(lengths) if lengths is not None else [width] * batch


def moves(tokens: int, generator: torch.Generator, tries: int) -> list[torch.Tensor]:
    """LAMP's discrete moves of one sequence's positions: the identity, then by turns a swap of two
    positions, a token moved elsewhere, a span moved elsewhere, a prefix put at the end."""
    out = [torch.arange(tokens)]
    if tokens < 2:
        return out

    def r(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=generator))

    for k in range(1, tries):
        p = list(range(tokens))
        kind = k % 4
        if kind == 0:
            i, j = r(tokens), r(tokens)
            p[i], p[j] = p[j], p[i]
        elif kind == 1:
            i, j = r(tokens), r(tokens)
            p.insert(j, p.pop(i))
        elif kind == 2:
            b, e = sorted((r(tokens), r(tokens)))
            span, rest = p[b : e + 1], p[:b] + p[e + 1 :]
            at = r(len(rest) + 1)
            p = rest[:at] + span + rest[at:]
        else:
            i = 1 + r(tokens - 1)
            p = p[i:] + p[:i]
        out.append(torch.tensor(p))
    return out


class EmbeddingMatch:
    """TAG, or LAMP with :class:`LampConfig` (module docstring)."""

    needs = AttackNeeds(update_kinds=("gradient", "delta"), sgd_delta=True)

    def __init__(self, config: EmbeddingMatchConfig | None = None) -> None:
        self.config = config or EmbeddingMatchConfig()

    def distance(self) -> Distance:
        return DISTANCE_OF[self.config.distance](self.config)

    def problem(self, obs: Observation) -> tuple[Inversion, torch.Tensor, torch.Tensor, int, int | None]:
        """The inversion problem of ``obs`` on a copy of its model, every input checked first (module
        docstring): the problem, the embedding table, the candidate vocabulary, T and T as read off the
        gradient (None where it does not show it)."""
        c = self.config
        require_sgd_reading(obs)
        model = obs.client_model()
        task = task_of(model)
        if c.midpoint_weights:
            at_midpoint(model, obs)
        table = input_embedding(model).weight.detach()
        pinned = [v for v in (c.first_token_id, c.last_token_id) if v is not None]
        if any(v >= table.shape[0] for v in pinned):
            raise AttackInputError(f"pinned token ids {pinned}: the model has {table.shape[0]} tokens")
        vocab = torch.unique(
            torch.cat([candidate_vocab(obs, model, c.vocab), torch.tensor(pinned, dtype=torch.long)])
        )
        read = sequence_length(obs, model)
        t = min(read or obs.input_shape[0], obs.input_shape[0])
        if obs.lengths is not None:
            t = max(obs.lengths)
            if task == "classification" and family_of(model).causal and len(set(obs.lengths)) > 1:
                raise AttackInputError(
                    f"{family_of(model).model_type}'s classifier pools each sequence's last token, which a "
                    "forward of input embeddings cannot place per sequence: granted lengths must be equal"
                )
        task_loss = TASK_LOSSES[task](obs, table, vocab, c, length_mask(obs.lengths, t))
        recovered = task_loss.labels if obs.labels is None else None
        if (
            recovered is not None
            and obs.lengths
            and len(set(obs.lengths)) > 1
            and recovered.unique().numel() > 1
        ):
            raise AttackInputError(
                "the labels are recovered as a multiset and the granted lengths differ: which label goes "
                "with which length is not known; grant them too (audit.grant_labels = true, as LAMP does)"
            )
        attention = getattr(model, "set_attn_implementation", None)
        if callable(attention):
            attention("eager")  # fused attention kernels have no double backward
        for p in model.parameters():
            p.requires_grad_(True)
        carried = [(n, p) for n, p in model.named_parameters() if n in obs.update.tensors]
        target = gradient_target(obs, carried)
        tied, name = tied_mask(model, vocab), embedding_param(model)
        masks = None if tied is None else [tied if n == name else None for n, _ in carried]
        problem = Inversion(
            model, [p for _, p in carried], target, task_loss, self.distance(), masks, obs.lengths,
        )  # fmt: skip
        return problem, table, vocab, t, read

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        c = self.config
        problem, table, vocab, t, read = self.problem(obs)
        model, b = problem.model, obs.update.num_samples
        norm = c.init_norm if c.init_norm is not None else float(table[vocab].norm(dim=-1).mean())
        lm = self._prior(model, table, vocab, b, t)
        start = time.perf_counter()  # a prior built (or trained) above is not the attack's own time
        x = self._start(problem, (b, t, table.shape[1]), norm, generator, table)
        ends = problem.lengths
        x.requires_grad_(True)
        opt = torch.optim.Adam([{"params": [x]}, *problem.variables], lr=c.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=c.lr_decay)
        best = (float("inf"), x.detach().clone())
        for step in bar(range(c.steps), desc=f"{type(self).__name__} steps"):
            opt.zero_grad(set_to_none=True)
            loss = self._total(problem, x, norm)
            if float(loss.detach()) < best[0]:  # the point this loss was taken at, before the step
                best = (float(loss.detach()), x.detach().clone())
            loss.backward()
            if c.grad_clip is not None and x.grad is not None:
                torch.nn.utils.clip_grad_norm_([x], c.grad_clip)
            opt.step()
            sched.step()
            self._pin(x, table, ends)
            if c.swap_every and step >= c.swap_burnin * c.steps and step % c.swap_every == 1 % c.swap_every:
                with torch.no_grad():
                    x.copy_(self._swap(problem, x.detach(), norm, generator, lm))
                self._pin(x, table, ends)
        ids = nearest_tokens(best[1], table, vocab)
        with torch.no_grad():  # the projected embeddings, scaled as LAMP scales them, scored once
            proj = table[ids] * (best[1].norm(dim=-1, keepdim=True) / table[ids].norm(dim=-1, keepdim=True))
        final = float(problem.objective(proj.requires_grad_(True), create_graph=False))
        stats = {"iterations": float(c.steps), "seconds": time.perf_counter() - start,
                 "matching_loss": final, "matching_loss_continuous": best[0], "sequence_length": float(t),
                 "length_read": float(read is not None and read <= obs.input_shape[0]),
                 "lengths_granted": float(ends is not None), "vocabulary": float(len(vocab)),
                 "prior": float(lm is not None)}  # fmt: skip
        labels = None if problem.loss.labels is None else problem.loss.labels.clone()
        stats["labels_recovered"] = float(labels is not None and obs.labels is None)
        token_ids = [row[:n] for row, n in zip(ids.tolist(), _lengths(ends, b, t), strict=True)]
        return Reconstruction(token_ids=token_ids, labels=labels, stats=stats)

    def _total(
        self, problem: Inversion, x: torch.Tensor, norm: float, *, create_graph: bool = True
    ) -> torch.Tensor:
        loss = problem.objective(x, create_graph=create_graph)
        if self.config.norm_weight:
            norms = x.norm(dim=-1)
            real = length_mask(problem.lengths, x.shape[1])
            mean = norms.mean() if real is None else norms[real.to(x.device).bool()].mean()
            loss = loss + self.config.norm_weight * (mean - norm).square()
        return loss

    def _inner(self, length: int) -> tuple[int, int]:
        """The positions ``[lo, hi)`` that are not pinned (``first_token_id``, ``last_token_id``)."""
        c = self.config
        return int(c.first_token_id is not None), max(1, length - int(c.last_token_id is not None))

    def _around(self, inner: torch.Tensor, length: int) -> torch.Tensor:
        """The permutation of ``length`` positions that moves the unpinned ones by ``inner`` (a permutation
        of ``range(hi - lo)``) and keeps the pinned ends."""
        lo, hi = self._inner(length)
        return torch.cat([torch.arange(lo), lo + inner, torch.arange(hi, length)])

    @torch.no_grad()
    def _pin(
        self, x: torch.Tensor, table: torch.Tensor, lengths: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """``x`` with the pinned tokens' embeddings at each sequence's first / last position (its granted
        length's last, else T's: LAMP's ``fix_special_tokens``); in place, and returned."""
        c = self.config
        if c.first_token_id is not None:
            x[:, 0] = table[c.first_token_id].to(x)
        if c.last_token_id is not None:
            for s, n in enumerate(_lengths(lengths, x.shape[0], x.shape[1])):
                if n > 1:
                    x[s, n - 1] = table[c.last_token_id].to(x)
        return x

    def _start(
        self,
        problem: Inversion,
        shape: tuple[int, int, int],
        norm: float,
        generator: torch.Generator,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """The best of ``init_candidates`` Gaussian draws by the distance, then of as many permutations of
        its unpinned positions (LAMP's ``get_init``), rescaled to ``norm`` where LAMP rescales
        (``norm_weight``); the pinned tokens in place throughout."""
        c = self.config
        like = problem.target[0]
        ends = problem.lengths

        def score(d: torch.Tensor) -> float:
            return float(problem.objective(d.clone().requires_grad_(True), create_graph=False))

        draws = (
            self._pin(torch.randn(shape, generator=generator).to(like), table, ends)
            for _ in range(c.init_candidates)
        )
        best = min(draws, key=score)
        if c.init_candidates > 1:

            def permuted() -> torch.Tensor:
                """``best`` with each sequence's unpinned real positions permuted (padding in place)."""
                rows = []
                for n in _lengths(ends, shape[0], shape[1]):
                    lo, hi = self._inner(n)
                    rows.append(torch.cat([self._around(torch.randperm(hi - lo, generator=generator), n),
                                           torch.arange(n, shape[1])]))  # fmt: skip
                index = torch.stack(rows).to(best.device)
                return best.gather(1, index.unsqueeze(-1).expand_as(best))

            best = min([best, *(permuted() for _ in range(c.init_candidates))], key=score)
        if c.norm_weight or c.init_norm is not None:
            best = best / best.norm(dim=-1, keepdim=True) * norm
        return self._pin(best.detach().clone(), table, ends)

    def _prior(
        self, model: nn.Module, table: torch.Tensor, vocab: torch.Tensor, batch: int, length: int
    ) -> PriorTerm | None:
        """The moves' language-model term (None without a prior): for a sequence's embeddings and the
        moves tried on it, ``prior_weight`` times the prior's mean NLL of each moved sequence's nearest
        tokens, over ``batch`` (LAMP adds the batch-mean loss of all B sequences, in which one moved
        sequence weighs 1/B). A prior for another vocabulary, or too short a context for ``length``
        tokens, is a configuration error, raised before any work."""
        c = self.config
        if c.prior.tokenizer is None:
            return None
        lm_vocab = vocabulary_size(c.prior.tokenizer)  # checked before a prior is trained
        if lm_vocab != vocab_size(model):
            raise ValueError(
                f"the prior's tokenizer ({c.prior.tokenizer!r}) has {lm_vocab} tokens, the model's embedding "
                f"{vocab_size(model)}: name the victim's tokenizer in prior.tokenizer"
            )
        if c.prior.kind == "gpt2" and length > c.prior.context:
            raise ValueError(
                f"the GPT-2 prior reads {c.prior.context} tokens (prior.context), the batch {length}"
            )
        prior = load_prior(c.prior)

        def term(seq: torch.Tensor, perms: list[torch.Tensor]) -> torch.Tensor:
            ids = nearest_tokens(seq.unsqueeze(0), table, vocab)[0]  # per position: moves permute the ids
            return c.prior_weight / batch * prior.nll(torch.stack([ids[p.to(ids.device)] for p in perms]))

        return term

    def _moves(self, tokens: int, generator: torch.Generator) -> list[torch.Tensor]:
        """The permutations of ``tokens`` unpinned positions one discrete step tries (LAMP's random moves)."""
        return moves(tokens, generator, self.config.swap_tries)

    def _swap(
        self,
        problem: Inversion,
        x: torch.Tensor,
        norm: float,
        generator: torch.Generator,
        lm: PriorTerm | None = None,
    ) -> torch.Tensor:
        """LAMP's discrete step: for each sequence, the move of its positions that lowers the objective
        (plus, with a prior, the language-model term of the moved sequence)."""
        out = x.clone()
        for s, n in enumerate(_lengths(problem.lengths, x.shape[0], x.shape[1])):
            lo, hi = self._inner(n)
            perms = [self._around(p, n) for p in self._moves(hi - lo, generator)]
            prior = lm(out[s, :n], perms) if lm is not None else None
            scored = []
            for j, perm in enumerate(perms):
                trial = out.clone()
                trial[s, :n] = out[s, perm]
                with torch.enable_grad():  # a score only: no graph through the gradient
                    total = self._total(problem, trial.requires_grad_(True), norm, create_graph=False)
                value = float(total.detach())
                scored.append((value + (float(prior[j]) if prior is not None else 0.0), j))
            _, j = min(scored)
            out[s, :n] = out[s, perms[j]]
        return out


class Tag(EmbeddingMatch):
    def __init__(self, config: EmbeddingMatchConfig | None = None) -> None:
        super().__init__(config or EmbeddingMatchConfig())


class Lamp(EmbeddingMatch):
    def __init__(self, config: LampConfig | None = None) -> None:
        super().__init__(config or LampConfig())


ATTACKS.register(
    "tag",
    Tag,
    config_cls=EmbeddingMatchConfig,
    summary="TAG: text from a classifier's or a causal LM's gradient, L2+L1 embedding matching (Deng et al.)",
    modality="text",
)
ATTACKS.register(
    "lamp",
    Lamp,
    config_cls=LampConfig,
    summary="LAMP: cosine embedding matching with discrete moves and an LM prior (Balunovic et al. 2022)",
    modality="text",
)

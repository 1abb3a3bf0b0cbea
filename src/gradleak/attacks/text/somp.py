"""SOMP as read here (Li and Li, "SOMP: Scalable gradient inversion for large language models via
subspace-guided orthogonal matching pursuit", arXiv 2603.16761, 2026; paper 002's [8]). **Our reading, not
a reproduction:** neither SOMP's code nor its method section is offline, only its abstract and paper 002's
description of it. The abstract casts text recovery from aggregated gradients as sparse signal recovery,
exploiting "head-wise geometric structure together with sample-level sparsity" to "progressively narrow the
search space and disentangle mixed signals without exhaustive search"; paper 002 says it "extends DAGER's
subspace test to a head-structured pooling stage followed by an Orthogonal Matching Pursuit reconstruction
over an LM-guided beam, scaling token recovery to larger batch sizes" (Sec. II-A), and that it "relies on
the Q-weight gradient subspace" (Sec. VI-E). Every choice those words leave open is a parameter.

1. **Tokens: DAGER's subspace test.** Block 1's input-side gradient (Q, K, V) gives the span of the batch's
   layer-1 inputs; the tokens (at each learned position) whose layer-1 input lies in it are the candidates
   (:class:`~gradleak.attacks.text.dager.core.Dager`, steps 1-2, unchanged).
2. **Head-structured pooling.** Block 2's input-side gradient G = sum_t y_t delta_t^T is split into its
   heads' column blocks G_h (Q, K and V, ``head_dim`` columns each), each scaled to unit Frobenius norm.
   Every column of every block is a combination of the same block-2 inputs y_t: a simultaneous sparse
   recovery problem (multiple measurement vectors; Tropp, Gilbert and Strauss, Signal Processing 2006) whose
   atoms are the block-2 inputs of candidate prefixes. An atom's *score* is simultaneous OMP's selection
   rule pooled over the heads: mean_h ||R_h^T a||^2 / ||a||^2, R_h the head block's residual after the
   chosen atoms' least-squares fit. Each head counts the same, whatever its gradient's scale.
3. **Orthogonal matching pursuit over the beam.** Sequences grow left to right over the whole batch at once,
   as DAGER's decoder search does (under causal attention a prefix's last block-2 input depends on the prefix
   alone). At each length, the extensions of every live prefix by the position's candidates are the
   dictionary. Those outside block 2's span (DAGER's L2 test) or repeating their prefix's last input are
   left out: where the span is not full, the L2 test accepts and OMP ranks. OMP picks the atom of highest
   score and projects it out, at most B (the update's sample count) a length. First each live prefix gets
   its best extension: any admissible one where the span is not full (the L2 test accepted it), else one
   scoring at least ``chance_ratio`` times what a random direction would (no L2 test there). Then branches
   (another extension of a prefix already extended) while the score is at least ``min_score`` (and that
   chance floor on a full span). A prefix with no picked extension is finished. A picked atom is projected
   out, so a branch that only re-explains what another prefix explains scores ~0, and no more than B
   prefixes are kept where DAGER keeps up to 64.
4. **LM guidance** (``prior``, optional: LAMP's kind of prior, :mod:`~gradleak.attacks.text.lm_prior`): the
   atoms are ranked by log score - ``prior_weight`` x the prior's mean NLL of the extended prefix; the score
   alone decides acceptance.
5. **Past DAGER's rank limit** (block 1's span full): the embedding rows' tokens (paper 002's Channel 2) at
   every position. OMP holds at most d atoms, so there it cannot hold every true prefix: the paper's
   "scaling" is not reproduced by this reading (docs/attacks-text.md, "SOMP as read here").

Last tokens (only labels under the next-token loss) come from the LM head as in DAGER. Scope: causal
language models (GPT-2 arch, SmolLM2/Llama), FedSGD; an encoder or a FedAvg delta is refused before work.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.attacks.text.dager.core import Dager, DagerConfig
from gradleak.attacks.text.dager.search import L2Search, Scored
from gradleak.attacks.text.family import (
    FamilySpec,
    Span,
    family_of,
    vocab_size,
)
from gradleak.attacks.text.lm_prior import LMPrior, LMPriorConfig, load_prior, vocabulary_size
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, AttackNeeds, Observation, Reconstruction

log = logging.getLogger(__name__)


def head_dim(model: nn.Module) -> int:
    """The attention heads' width: ``config.head_dim`` where set (Llama), else hidden size / heads."""
    config = getattr(model, "config", None)
    explicit = getattr(config, "head_dim", None)
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
        raise AttackInputError("SOMP reads the attention heads' width off the model's config; it has none")
    return hidden // heads


class HeadPool:
    """Step 2: the head blocks of an input-side gradient (d, k), each of unit Frobenius norm (heads below
    ``floor`` of the largest head's norm, float rounding, are left out), and the atoms chosen so far (an
    orthonormal basis of their span)."""

    def __init__(self, grad: torch.Tensor, width: int, floor: float = 1e-6) -> None:
        if grad.shape[1] % width:
            raise AttackInputError(f"the gradient's {grad.shape[1]} columns are not whole heads of {width}")
        blocks = grad.to(torch.float64).T.reshape(-1, width, grad.shape[0])  # (heads, width, d)
        norms = blocks.flatten(1).norm(dim=1)
        keep = norms > floor * norms.max() if norms.numel() and float(norms.max()) > 0 else norms > 0
        self.blocks = blocks[keep] / norms[keep, None, None]
        self.basis = grad.new_zeros((grad.shape[0], 0), dtype=torch.float64)

    @property
    def heads(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def dim(self) -> int:
        return int(self.basis.shape[0])

    def orthogonal(self, z: torch.Tensor) -> torch.Tensor:
        """The components of the rows of ``z`` (n, d) orthogonal to the chosen atoms."""
        z = z.to(torch.float64)
        return z - (z @ self.basis) @ self.basis.T

    def scores(self, z: torch.Tensor, tol: float) -> torch.Tensor:
        """Simultaneous OMP's selection score of each atom (row of ``z``): the pooled squared correlation
        of the unit atom with the residual, mean_h ||R_h^T z||^2 / ||z||^2 (R_h: head block h with the
        chosen atoms' least-squares fit removed; R_h^T z = G_h^T z_perp, z_perp the atom's component off the
        chosen ones). An atom nearly inside the chosen span scores nearly 0; below ``tol`` of its norm off
        it, exactly 0."""
        z = z.to(torch.float64)
        perp = self.orthogonal(z)
        norm, full = perp.norm(dim=1), z.norm(dim=1).clamp_min(1e-300)
        score = torch.einsum("hwd,nd->nhw", self.blocks, perp).pow(2).sum(-1).mean(-1) / full.pow(2)
        return torch.where(norm > tol * full, score, torch.zeros_like(score))

    def add(self, z: torch.Tensor, tol: float) -> None:
        """Project ``z`` out from now on; an atom less than ``tol`` of its norm off the chosen span adds no
        direction (its remainder is rounding) and leaves the basis as it is."""
        z = z.to(torch.float64)
        perp = self.orthogonal(self.orthogonal(z.unsqueeze(0)))[0]  # twice: Gram-Schmidt keeps its basis
        if float(perp.norm()) <= tol * float(z.norm()):
            return
        self.basis = torch.cat([self.basis, (perp / perp.norm())[:, None]], dim=1)

    def explained(self) -> float:
        """The pooled share of the gradient the chosen atoms explain, in [0, 1] (0 without heads)."""
        if self.heads == 0:
            return 0.0
        return float(torch.einsum("hwd,dm->hwm", self.blocks, self.basis).pow(2).sum((1, 2)).mean())

    def chance(self) -> float:
        """The score a random unit direction orthogonal to the chosen atoms gets in expectation: the
        unexplained share over the dimensions left, (1 - explained) / (d - chosen)."""
        return (1.0 - self.explained()) / max(1, self.dim - self.basis.shape[1])


@dataclass(frozen=True)
class SompConfig(DagerConfig):
    """DAGER's span tests and token candidates (the parent's options; the decoder's ``search`` and
    ``beam_width`` and the ``encoder`` options are not used: OMP keeps at most B prefixes, and encoders are
    refused), and steps 2-4:
    - ``min_score``: the smallest OMP score an atom must reach (ours: 1e-9, above float64 rounding of an
      atom inside the chosen span);
    - ``parallel_tol``: an atom whose component off the chosen ones is below this share of its norm adds no
      direction (ours: 1e-3);
    - ``chance_ratio``: where block 2's span is full (no span test), an atom must also score this many times
      what a random direction would (:meth:`HeadPool.chance`; ours: 2, from the tiny GPT-2 under Prune-50 %:
      1 let a wrong token trail the one sentence, 4 lost one of two sentences and 3 of 3);
    - ``prior`` / ``prior_weight``: the LM guidance (none by default)."""

    min_score: float = 1e-9
    parallel_tol: float = 1e-3
    chance_ratio: float = 2.0
    prior_weight: float = 0.0
    prior: LMPriorConfig = field(default_factory=LMPriorConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.min_score < 1:
            raise ValueError(f"min_score must be in (0, 1), got {self.min_score}")
        if not 0 < self.parallel_tol < 1:
            raise ValueError(f"parallel_tol must be in (0, 1), got {self.parallel_tol}")
        if not 1 <= self.chance_ratio < float("inf"):
            raise ValueError(f"chance_ratio must be a finite number >= 1, got {self.chance_ratio}")
        if not 0 <= self.prior_weight < float("inf"):
            raise ValueError(f"prior_weight must be a finite number >= 0, got {self.prior_weight}")
        if not isinstance(self.prior, LMPriorConfig):
            raise TypeError(f"prior must be an LMPriorConfig, got {type(self.prior).__name__}")
        if (self.prior.tokenizer is None) != (self.prior_weight == 0):
            raise ValueError(
                "prior.tokenizer and prior_weight go together: name the victim's tokenizer and give a weight "
                f"> 0, or neither (got {self.prior.tokenizer!r} and {self.prior_weight})"
            )
        if (
            self.prior.tokenizer is not None
            and self.prior.kind == "gpt2"
            and self.prior.context < self.max_positions
        ):
            raise ValueError(
                f"the GPT-2 prior reads {self.prior.context} tokens (prior.context), fewer than "
                f"max_positions ({self.max_positions}): raise prior.context or lower max_positions"
            )


PRIOR_CHUNK = 256  # extended prefixes the prior scores at once


@dataclass
class OmpSearch(L2Search):
    """Step 3 (and 4): the decoder search by simultaneous OMP over block 2's head blocks."""

    pool: HeadPool | None = None
    batch: int = 1
    min_score: float = 1e-9
    parallel_tol: float = 1e-3
    chance_ratio: float = 2.0
    prior: LMPrior | None = None
    prior_weight: float = 0.0

    def extend(self, cands: list[list[int]], search: str, beam_width: int) -> list[Scored]:
        """Grow the batch's prefixes length by length, each length's extensions picked by OMP (step 3).
        ``search`` and ``beam_width`` are DAGER's and unused: at most B prefixes are live."""
        if not cands or self.pool is None:
            return []
        firsts = [[v] for v in cands[0]]
        z = self.block2_inputs(torch.tensor(cands[0]).unsqueeze(1))[:, 0]
        scores: dict[tuple[int, ...], float] = {}
        live = self.pick(firsts, z, self.admissible(z, None), scores)
        done: list[list[int]] = []
        for p in range(1, len(cands)):
            if not live:
                break
            group = max(1, self.chunk // (8 * len(cands[p])))
            parts = [self.extension_inputs(live[i : i + group], cands[p]) for i in range(0, len(live), group)]
            z = torch.cat([zz for zz, _ in parts])
            prev = torch.cat([pp for _, pp in parts])
            seqs = [s + [v] for s in live for v in cands[p]]
            parents = torch.arange(len(live)).repeat_interleave(len(cands[p]))
            nxt = self.pick(seqs, z, self.admissible(z, prev), scores, parents)
            grown = {tuple(s[:-1]) for s in nxt}
            done += [s for s in live if tuple(s) not in grown]
            live = nxt
        done += live
        return [(s, -sum(scores.get(tuple(s[:i]), 0.0) for i in range(1, len(s) + 1))) for s in done]

    def admissible(self, z: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        """The atoms OMP may pick: inside block 2's span (unless it is full: no test) and, for extensions,
        not repeating the prefix's last block-2 input (DAGER's ``repeat_tol``)."""
        ok = torch.ones(z.shape[0], dtype=torch.bool)
        if not self.span.full:
            ok &= self.span.residual(z) < self.threshold
        if prev is not None:
            ok &= ~self.repeats(z, prev)
        return ok

    def pick(
        self,
        seqs: list[list[int]],
        z: torch.Tensor,
        ok: torch.Tensor,
        scores: dict[tuple[int, ...], float],
        parents: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """OMP over the admissible atoms ``z[ok]`` of ``seqs``: the highest-ranked atom is chosen and
        projected out, at most B in all; their scores go to ``scores``. With ``parents`` (each extension's
        live prefix), every prefix first gets its best extension (where the span is not full whatever its
        score, the L2 test having accepted it; on a full span one scoring >= ``chance_ratio`` times chance),
        so a wrong extension cannot close a true prefix by taking its place under the cap. Then (and for
        first tokens, without parents) atoms are picked while they score >= ``min_score`` (and, on a full
        span, the chance floor)."""
        assert self.pool is not None
        idx = torch.nonzero(ok).flatten()
        if idx.numel() == 0:
            return []
        z = z[idx]
        parent = parents[idx] if parents is not None else None
        unserved = set(parent.tolist()) if parent is not None else set()
        penalty = torch.zeros(len(idx), dtype=torch.float64)  # a first token: nothing to predict
        if self.prior is not None and len(seqs[0]) > 1:
            ids = torch.tensor([seqs[int(i)] for i in idx])
            nll = torch.cat([self.prior.nll(c) for c in ids.split(PRIOR_CHUNK)])
            penalty = self.prior_weight * nll.to(torch.float64)
        free = torch.ones(len(idx), dtype=torch.bool)
        chosen: list[int] = []
        while len(chosen) < self.batch and free.any():
            score = self.pool.scores(z, self.parallel_tol)
            floor = self.min_score
            if self.span.full:
                floor = max(floor, self.chance_ratio * self.pool.chance())
            eligible = free & (score >= floor)
            if parent is not None and unserved:
                serve = free & torch.isin(parent, torch.tensor(sorted(unserved)))
                # where the L2 test accepted them, a prefix's extensions need no score: OMP only ranks them
                # (a true input close to chosen ones, e.g. a repeated <unk>, scores ~0 and must not close it)
                eligible = serve if not self.span.full else eligible & serve
            rank = torch.where(eligible, score.clamp_min(1e-300).log() - penalty, -math.inf)
            j = int(rank.argmax())
            if rank[j] == -math.inf:
                if unserved:  # no prefix left to serve: branches next
                    unserved.clear()
                    continue
                break
            scores[tuple(seqs[int(idx[j])])] = float(score[j])
            self.pool.add(z[j], self.parallel_tol)
            chosen.append(int(idx[j]))
            free[j] = False
            if parent is not None:
                unserved.discard(int(parent[j]))
        return [seqs[j] for j in chosen]


class Somp(Dager):
    """SOMP as read here (module docstring): DAGER's token candidates, then OMP over block 2's head blocks."""

    needs = AttackNeeds(update_kinds=("gradient",))

    def __init__(self, config: SompConfig | None = None) -> None:
        super().__init__(config or SompConfig())
        self._pool: HeadPool | None = None
        self._rows: list[int] | None = None
        self._prior: LMPrior | None = None
        self._fallback = False
        self._batch = 1
        self._width = 1

    @property
    def somp(self) -> SompConfig:
        assert isinstance(self.config, SompConfig)
        return self.config

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        model = obs.model  # read only here; DAGER's pipeline below works on its own copy
        if not family_of(model).causal:
            raise AttackInputError(
                "SOMP's beam grows causal prefixes (a prefix's block-2 input depends on the prefix alone): "
                f"it needs a causal language model, not {type(model).__name__}"
            )
        if obs.update.kind != "gradient":
            raise AttackInputError("SOMP reads one FedSGD gradient; this update is a FedAvg delta")
        self._prior = self.prior(model)
        self._width = head_dim(model)
        self._batch = max(1, obs.update.num_samples)
        self._pool = None  # built from block 2's gradient in :meth:`spans`
        self._rows = self.embedding_rows(obs, model)
        self._fallback = False
        out = super().reconstruct(obs, generator=generator)
        assert self._pool is not None  # DAGER's pipeline reads the spans before it returns
        stats = {**out.stats, "heads": float(self._pool.heads), "explained_l2": self._pool.explained(),
                 "rows_fallback": float(self._fallback)}  # fmt: skip
        return Reconstruction(token_ids=out.token_ids, stats=stats)

    def spans(
        self, obs: Observation, spec: FamilySpec, grad1: torch.Tensor, grad2: torch.Tensor
    ) -> tuple[Span, Span, FamilySpec, dict[str, float]]:
        """DAGER's spans; block 2's gradient also gives step 2's head blocks."""
        self._pool = HeadPool(grad2, self._width)
        return super().spans(obs, spec, grad1, grad2)

    def unreadable(self, span1: Span, span2: Span, grads: list[torch.Tensor]) -> bool:
        """Past DAGER's rank limit: a full block-2 span drops the span test from step 3 (OMP's scores
        against chance decide), and a full block-1 span falls back to the embedding channel's tokens at
        every position (:meth:`position_candidates`); only a full block-1 span without that channel is
        unreadable. OMP holds at most d atoms, so past the limit it cannot hold every true prefix."""
        full1 = span1.full or self.saturated(span1, grads[0])
        return full1 and self._rows is None

    def position_candidates(
        self, model: nn.Module, spec: FamilySpec, module: nn.Module, span: Span, scan: torch.Tensor
    ) -> list[list[int]]:
        if not span.full:
            return super().position_candidates(model, spec, module, span, scan)
        assert self._rows is not None
        self._fallback = True
        log.info("SOMP: block 1's span is full; %d embedding-row tokens at each position", len(self._rows))
        return [self._rows] * self.config.max_positions

    def prior(self, model: nn.Module) -> LMPrior | None:
        """The LM prior, built (or loaded) before any other work; one for another vocabulary is refused
        before it is built."""
        c = self.somp
        if c.prior.tokenizer is None:
            return None
        if vocabulary_size(c.prior.tokenizer) != vocab_size(model):
            raise AttackInputError(
                f"the prior's tokenizer ({c.prior.tokenizer!r}) is not the model's vocabulary: name the "
                "victim's tokenizer in prior.tokenizer"
            )
        return load_prior(c.prior)

    def l2_search(
        self, model: nn.Module, m2: nn.Module, span2: Span, threshold: float, m1: nn.Module,
        generator: torch.Generator,
    ) -> L2Search:  # fmt: skip
        c = self.somp
        return OmpSearch(
            model, m2, span2, threshold, c.chunk, c.repeat_tol, m1,
            pool=self._pool, batch=self._batch, min_score=c.min_score, parallel_tol=c.parallel_tol,
            chance_ratio=c.chance_ratio, prior=self._prior, prior_weight=c.prior_weight,
        )  # fmt: skip


ATTACKS.register(
    "somp",
    Somp,
    config_cls=SompConfig,
    summary="SOMP as read here: DAGER's token test, then OMP over block 2's head blocks (Li and Li 2026)",
    modality="text",
)

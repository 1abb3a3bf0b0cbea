"""DAGER: exact gradient inversion for transformer LMs (Petrov et al., NeurIPS 2024; paper 002, Sec. III-C).

1. **Span estimation (L1).** The input-side gradient of block 1's attention projections (GPT-2: the fused
   ``c_attn``; Llama/BERT: Q, K and V stacked) is sum_t delta_t x_t^T; its SVD gives a basis of span{x_t}
   with rank = the number of tokens in the batch (needs rank < d). The same is done for block 2.
2. **Token filtering.** For every vocabulary token v (with ``vocab="embedding"``: every token the
   embedding row-norm channel keeps, paper 002's "combined recovery") and, with learned positions, every
   position p, the layer-1 input z(v, p) = LN(E[v] + P[p] (+ T[0])) is computed by the model itself;
   v is a candidate at p iff its relative residual to the L1 span is below ``l1_threshold``. Rotary
   models (Llama) have position-free layer-1 inputs, so one candidate set serves every position.
3. **Decoders (causal): extension.** Sequences grow left to right from the first tokens whose block-2
   input lies in the L2 span; prefix s + v is kept iff the block-2 input of its last token (which under
   causal attention depends on the prefix only) lies in the L2 span.
   ``search="greedy"`` keeps each prefix's best extension, ``"beam"`` keeps every accepted one up to
   ``beam_width`` prefixes. A prefix with no accepted extension is a finished sequence.
4. **Encoders (BERT): search.** Whole sequences of each length are drawn from the per-position candidate
   sets, exhaustively when there are at most ``max_samples`` of them, else ``max_samples`` random draws
   each refined by coordinate descent on the mean L2 residual; a sequence is accepted iff all its block-2
   inputs lie in the L2 span. With ``end_token_id`` (BERT's [SEP]) only lengths whose last position can
   hold it are searched. ``fill_to_batch`` completes B with the best rejected sequences (up to B per
   length, lowest L2 residual first).
5. **Batch assembly.** Of the accepted sequences, the ``B`` (= ``update.num_samples``) with the smallest
   L2 residual are returned, longest first among ties.

Under the causal-LM loss the last token of each sequence reaches no layer-1 gradient (it is only a label);
``complete_last_token`` reads it off the LM-head gradient (:mod:`lm_completion`). Classification losses
expose all tokens to the span checks.

``dager_fedavg`` attacks a FedAvg delta: -delta is used as the gradient, candidate inputs are computed at
the midpoint weights w_0 + delta / 2 and the thresholds are relaxed (DAGER Sec. 6, FedAvg).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.attacks.text.family import (
    FamilySpec,
    Span,
    capture_input,
    embedding_param,
    estimate_span,
    family_of,
    find_module,
    input_side_gradient,
    layer_inputs,
    update_tensor,
    vocab_size,
    with_thresholds,
)
from gradleak.attacks.text.lm_completion import complete_last_tokens, output_embedding
from gradleak.attacks.text.rownorm import RowNormConfig, select_rows
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DagerConfig:
    """Thresholds default (None) to the family's (see ``family.FAMILIES``)."""

    l1_threshold: float | None = None
    l2_threshold: float | None = None
    rank_tol: float | None = None
    max_positions: int = 64  # sequences are at most 64 tokens (paper 002)
    search: str = "beam"  # decoders: "greedy" or "beam"
    beam_width: int = 64
    max_samples: int = 4096  # encoders: sequences evaluated per length
    max_candidates: int = 512  # per position; more means the span check is not discriminating
    chunk: int = 4096
    midpoint_weights: bool = False  # evaluate candidates at w_0 + delta/2 (FedAvg)
    complete_last_token: bool = True  # causal LM: read each sequence's last token off the LM head
    vocab: str = "full"  # "full" or "embedding": scan only the embedding row-norm channel's token set
    end_token_id: int | None = None  # encoders: a token that ends every sequence ([SEP]); limits lengths
    fill_to_batch: bool = True  # encoders: complete B with the best rejected sequences (partial recovery)

    def __post_init__(self) -> None:
        for name in ("l1_threshold", "l2_threshold", "rank_tol"):
            v = getattr(self, name)
            if v is not None and not 0 < v < 1:
                raise ValueError(f"{name} must be in (0, 1), got {v}")
        if self.vocab not in ("full", "embedding"):
            raise ValueError(f"vocab must be 'full' or 'embedding', got {self.vocab!r}")
        if self.search not in ("greedy", "beam"):
            raise ValueError(f"search must be 'greedy' or 'beam', got {self.search!r}")
        for name in ("max_positions", "beam_width", "max_samples", "max_candidates", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class DagerFedAvgConfig(DagerConfig):
    l1_threshold: float | None = 0.05
    l2_threshold: float | None = 0.1
    midpoint_weights: bool = True


class Dager:
    """The DAGER pipeline (module docstring); reads only ``obs.model`` and ``obs.update``."""

    def __init__(self, config: DagerConfig | None = None) -> None:
        self.config = config or DagerConfig()

    def spec(self, model: nn.Module) -> FamilySpec:
        c = self.config
        return with_thresholds(
            family_of(model), l1_threshold=c.l1_threshold, l2_threshold=c.l2_threshold, rank_tol=c.rank_tol
        )

    def attacker_model(self, obs: Observation) -> nn.Module:
        model = copy.deepcopy(obs.model).eval()
        if self.config.midpoint_weights and obs.update.kind == "delta":
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in obs.update.tensors:
                        p.add_(obs.update.tensors[name].to(p.dtype), alpha=0.5)
        return model

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        start = time.perf_counter()
        model = self.attacker_model(obs)
        spec = self.spec(model)
        span1 = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 0), spec.rank_tol)
        span2 = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
        if span1.rank == 0:
            raise AttackInputError("the first block's attention gradient is zero (frozen or masked)")
        if span1.full or span2.full:
            log.warning("DAGER: the attention-gradient span is full rank; nothing can be recovered")
            return Reconstruction(token_ids=[], stats={"rank_l1": float(span1.rank), "span_full": 1.0})
        m1 = find_module(model, spec.attn_inputs[0].format(i=0))[1]
        m2 = find_module(model, spec.attn_inputs[0].format(i=1))[1]
        cands = self.position_candidates(model, spec, m1, span1, self.scan_vocab(obs, model))
        fallback: list[tuple[list[int], float]] = []
        b = max(1, obs.update.num_samples)
        if spec.causal:
            found = self.extend(model, spec, m2, span2, cands)
        else:
            found, fallback = self.encoder_search(model, spec, m2, span2, cands, generator, b)
        found.sort(key=lambda sr: (sr[1], -len(sr[0])))
        seqs = [s for s, _ in found[:b]]
        filled = 0
        if not spec.causal and self.config.fill_to_batch and len(seqs) < b:
            for s, _ in sorted(fallback, key=lambda sr: sr[1]):
                if len(seqs) < b and s not in seqs:
                    seqs.append(s)
                    filled += 1
        if self.config.complete_last_token and spec.causal:
            if _has_lm_head(model):
                seqs = complete_last_tokens(obs, model, seqs)
        stats = {
            "rank_l1": float(span1.rank),
            "rank_l2": float(span2.rank),
            "positions": float(len(cands)),
            "candidates": float(sum(len(c) for c in cands)),
            "accepted": float(len(found)),
            "filled": float(filled),
            "seconds": time.perf_counter() - start,
        }
        log.info("DAGER: L1 rank %d, %d positions, %d accepted sequences", span1.rank, len(cands), len(found))
        return Reconstruction(token_ids=seqs, stats=stats)

    def scan_vocab(self, obs: Observation, model: nn.Module) -> torch.Tensor:
        """The token ids the L1 filter scans: the whole vocabulary, or the embedding channel's set.

        ``vocab="embedding"`` combines DAGER with paper 002's Channel 2 ("combined recovery", Sec. III-C):
        only the tokens the embedding row-norm selection keeps are scanned; the full vocabulary when the
        update lacks the embedding gradient.
        """
        full = torch.arange(vocab_size(model))
        if self.config.vocab == "full" or embedding_param(model) not in obs.update.tensors:
            return full
        tokens, _ = select_rows(update_tensor(obs, embedding_param(model)), RowNormConfig())
        return torch.tensor(sorted(tokens), dtype=torch.long) if tokens else full

    def position_candidates(
        self, model: nn.Module, spec: FamilySpec, module: nn.Module, span: Span, scan: torch.Tensor
    ) -> list[list[int]]:
        """Token ids passing the L1 check at each position 0, 1, ... (until a position has none)."""
        vocab = scan.unsqueeze(1)
        positions = self.config.max_positions if spec.positions == "learned" else 1
        out: list[list[int]] = []
        for p in range(positions):
            z = layer_inputs(model, module, vocab, start_position=p, chunk=self.config.chunk)[:, 0]
            ok, res = span.below(z, spec.l1_threshold)
            if ok.numel() == 0:
                break
            if ok.numel() > self.config.max_candidates:
                ok = ok[res.argsort()[: self.config.max_candidates]]
            out.append(scan[ok].tolist())
        if spec.positions == "rotary" and out:
            out = out * self.config.max_positions
        return out

    def _l2_residual(
        self,
        model: nn.Module,
        module: nn.Module,
        span: Span,
        seqs: torch.Tensor,
        last_only: bool,
        reduce: str = "max",
    ) -> torch.Tensor:
        z = layer_inputs(model, module, seqs, chunk=max(1, self.config.chunk // seqs.shape[1]))
        res = span.residual(z[:, -1] if last_only else z)
        if last_only:
            return res
        return res.max(dim=1).values if reduce == "max" else res.mean(dim=1)

    def extend(
        self, model: nn.Module, spec: FamilySpec, module: nn.Module, span: Span, cands: list[list[int]]
    ) -> list[tuple[list[int], float]]:
        """Decoder search: grow prefixes token by token under the L2 check (module docstring, step 3)."""
        if not cands:
            return []
        # first tokens: under causal attention their block-2 input depends on themselves only
        first = self._l2_residual(model, module, span, torch.tensor(cands[0]).unsqueeze(1), last_only=True)
        live = [([v], float(r)) for v, r in zip(cands[0], first, strict=True) if r < spec.l2_threshold]
        done: list[tuple[list[int], float]] = []
        for p in range(1, len(cands) + 1):
            if not live:
                break
            if p == len(cands):
                done += live
                break
            pairs = [(s, v) for s, _ in live for v in cands[p]]
            group = max(1, self.config.chunk // (8 * len(cands[p])))
            res = torch.cat(
                [
                    self._extension_residuals(
                        model, module, span, [s for s, _ in live[i : i + group]], cands[p]
                    )
                    for i in range(0, len(live), group)
                ]
            )
            nxt: list[tuple[list[int], float]] = []
            for s, r in live:
                idx = [i for i, (q, _) in enumerate(pairs) if q is s and res[i] < spec.l2_threshold]
                if not idx:
                    done.append((s, r))
                    continue
                idx.sort(key=lambda i: float(res[i]))
                keep = idx[:1] if self.config.search == "greedy" else idx
                nxt += [(pairs[i][0] + [pairs[i][1]], max(r, float(res[i]))) for i in keep]
            nxt.sort(key=lambda sr: sr[1])
            live = nxt[: self.config.beam_width]
        return done

    def _extension_residuals(
        self, model: nn.Module, module: nn.Module, span: Span, prefixes: list[list[int]], cands: list[int]
    ) -> torch.Tensor:
        """L2 residual of the last token of ``s + [v]`` for each prefix s (outer) and candidate v (inner).

        The prefixes (all of one length) run once through block 1 into a key/value cache that every
        candidate reuses (one token each); without a usable cache whole sequences are recomputed (same
        result).
        """
        n, t = len(prefixes), len(prefixes[0])
        ids = torch.tensor(cands).repeat(n).unsqueeze(1)
        try:
            from transformers import DynamicCache

            cache = DynamicCache()
            # transformers >= 5.x names the argument `cache` (`past_key_values` is deprecated)
            key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            capture_input(model, module, input_ids=torch.tensor(prefixes), use_cache=True, **{key: cache})
            cache.batch_repeat_interleave(len(cands))
            pos = torch.full((n * len(cands), 1), t)
            z = capture_input(model, module, input_ids=ids, use_cache=True, position_ids=pos, **{key: cache})
            z = z[:, -1]
        except (ImportError, TypeError, AttributeError, RuntimeError, ValueError) as err:
            log.debug("no KV-cache fast path (%s); recomputing whole prefixes", err)
            seqs = torch.cat([torch.tensor(prefixes).repeat_interleave(len(cands), dim=0), ids], dim=1)
            return self._l2_residual(model, module, span, seqs, last_only=True)
        return span.residual(z)

    def encoder_search(
        self,
        model: nn.Module,
        spec: FamilySpec,
        module: nn.Module,
        span: Span,
        cands: list[list[int]],
        generator: torch.Generator,
        batch: int = 1,
    ) -> tuple[list[tuple[list[int], float]], list[tuple[list[int], float]]]:
        """Accepted sequences and the ``batch`` best of each searched length (module docstring, step 4)."""
        found: list[tuple[list[int], float]] = []
        fallback: list[tuple[list[int], float]] = []
        end = self.config.end_token_id
        for length in range(1, len(cands) + 1):
            if end is not None and end not in cands[length - 1]:
                continue
            sets = cands[:length]
            if end is not None:
                sets = [*sets[:-1], [end]]
            total = 1
            for c in sets:
                total *= len(c)
            if total <= self.config.max_samples:
                seqs = torch.tensor(list(itertools.product(*sets)))
            else:
                seqs = self._refined_samples(model, module, span, sets, generator)
            res = self._l2_residual(model, module, span, seqs, last_only=False)
            for i in torch.nonzero(res < spec.l2_threshold).flatten().tolist():
                found.append((seqs[i].tolist(), float(res[i])))
            for i in res.argsort()[:batch].tolist():
                fallback.append((seqs[i].tolist(), float(res[i])))
        return found, fallback

    def _refined_samples(
        self,
        model: nn.Module,
        module: nn.Module,
        span: Span,
        sets: list[list[int]],
        generator: torch.Generator,
    ) -> torch.Tensor:
        """Random candidate sequences, each improved by coordinate descent on the L2 residual."""
        n = max(2, self.config.max_samples // (4 * sum(len(c) for c in sets)))
        draws = torch.stack(
            [torch.tensor(c)[torch.randint(len(c), (n,), generator=generator)] for c in sets], dim=1
        )
        for _ in range(2):
            for p, c in enumerate(sets):
                if len(c) == 1:
                    continue
                trial = draws.repeat_interleave(len(c), dim=0)
                trial[:, p] = torch.tensor(c).repeat(draws.shape[0])
                res = self._l2_residual(model, module, span, trial, last_only=False, reduce="mean")
                res = res.view(-1, len(c))
                draws[:, p] = torch.tensor(c)[res.argmin(dim=1)]
        return torch.unique(draws, dim=0)


def _has_lm_head(model: nn.Module) -> bool:
    return output_embedding(model) is not None


class DagerFedAvg(Dager):
    def __init__(self, config: DagerFedAvgConfig | None = None) -> None:
        super().__init__(config or DagerFedAvgConfig())


ATTACKS.register(
    "dager",
    Dager,
    config_cls=DagerConfig,
    summary="DAGER: exact text from attention-gradient spans (Petrov 2024)",
)
ATTACKS.register(
    "dager_fedavg",
    DagerFedAvg,
    config_cls=DagerFedAvgConfig,
    summary="DAGER on a FedAvg pseudo-gradient (-delta, midpoint weights)",
)

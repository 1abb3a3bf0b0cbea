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
   ``decoder.search="greedy"`` keeps each prefix's best extension, ``"beam"`` keeps every accepted one up
   to ``beam_width`` prefixes. A prefix with no accepted extension is a finished sequence.
4. **Encoders (BERT): search.** Bidirectional attention gives no exact prefix check, and with learned
   positions the L1 filter passes the batch's tokens at (nearly) every position. ``encoder.method="polish"``
   (default): rounds of a left-to-right beam under a prefix-only L2 score, each round's best closures
   (one per first word) polished by exact local search on whole sequences (mean log10 L2 residual;
   substitutions and insertions screened with the full bidirectional context, deletions, moves, swaps;
   on a stall every token at the worst positions, evaluated exactly); a sequence is accepted iff all its
   block-2 inputs lie in the L2 span. Rounds after a sentence is held grow no 4-gram of it
   (``held_ngram``) and every other round starts from first words no held sentence contains
   (``fresh_first_words``), and their prefix score is the L2 residual times exp(-``novelty`` * f), f the
   fraction of a block-2 input's in-span part outside the span of the held sentences' (exactly known)
   block-2 inputs: pieces of held sentences re-grown in new order score f ~ 0.05-0.1, the missing
   sentences' own tokens ~ 0.6-0.7, so the beam stops re-growing what it already has. ``"beam"`` is the
   same beam with a greedy repair instead; ``"sample"`` draws whole sequences per length (exhaustive up to
   ``max_samples``, else sampled and refined by coordinate descent). With ``end_token_id`` (BERT's [SEP])
   sequences end with it. ``fill_to_batch`` completes B with the best rejected sequences. On a FedSGD
   classifier gradient (``peel``) each newly held sentence's own gradient is subtracted from the update
   once block 2's rank falls by its length under some class, and the spans and candidates are re-read
   from what is left (:mod:`~gradleak.attacks.text.dager.peel`): the search then sees only the missing
   sentences.
5. **Batch assembly.** Of the accepted sequences, the ``B`` (= ``update.num_samples``) with the smallest
   L2 residual are returned, longest first among ties.

Under the causal-LM loss the last token of each sequence reaches no layer-1 gradient (it is only a label);
``complete_last_token`` reads it off the LM-head gradient (:mod:`lm_completion`). Classification losses
expose all tokens to the span checks.

``dager_fedavg`` attacks a FedAvg delta: -delta is used as the gradient, candidate inputs are computed at
the midpoint weights w_0 + delta / 2 and the thresholds are relaxed (DAGER Sec. 6, FedAvg).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from gradleak.attacks.text.dager.peel import Peeler
from gradleak.attacks.text.dager.search import L2Search, PolishConfig, Polished, Scored, echoes, similar
from gradleak.attacks.text.embedding_match import task_of
from gradleak.attacks.text.family import (
    FamilySpec,
    Span,
    at_midpoint,
    embedding_param,
    estimate_span,
    family_of,
    find_module,
    input_side_gradient,
    input_side_layout,
    layer_inputs,
    update_tensor,
    vocab_size,
    with_thresholds,
)
from gradleak.attacks.text.lm_completion import add_prefix_sentences, complete_last_tokens, output_embedding
from gradleak.attacks.text.rownorm import RowNormConfig, select_rows
from gradleak.progress import bar
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)

# :meth:`Dager.peel_held`'s answer: the L1 candidates re-read from what is left, every sentence peeled
Repeeled = tuple[list[list[int]], list[list[int]]]


def _at_least(obj: object, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {getattr(obj, name)}")


@dataclass(frozen=True)
class DecoderSearch:
    """Step 3, decoders (causal attention): ``search`` ``"greedy"`` (each prefix's best extension) or
    ``"beam"``; ``complete_last_token`` reads each sequence's last token off the LM head; with fewer than B
    sequences found, ``prefix_sentences`` adds prefix / repeated sentences the LM head accepts (residual off
    the label rows below ``prefix_tol``)."""

    search: str = "beam"
    complete_last_token: bool = True
    prefix_sentences: bool = True
    prefix_tol: float = 1e-4

    def __post_init__(self) -> None:
        if self.search not in ("greedy", "beam"):
            raise ValueError(f"search must be 'greedy' or 'beam', got {self.search!r}")
        if not 0 < self.prefix_tol < 1:
            raise ValueError(f"prefix_tol must be in (0, 1), got {self.prefix_tol}")


@dataclass(frozen=True)
class EncoderSearch:
    """Step 4, encoders (bidirectional attention): ``method`` ``"polish"`` (beam + exact local search),
    ``"beam"`` (+ greedy repair) or ``"sample"``. The beam keeps ``per_prefix`` extensions per prefix once
    full and runs up to ``rounds`` rounds, each without the held sentences' first words
    (``fresh_first_words`` on odd rounds), growing no ``held_ngram``-gram of a held sentence (0: off) and
    preferring block-2 inputs outside the held sentences' span (``novelty``); ``"polish"`` polishes up to
    ``polish_tries`` closures per round with ``polish``
    (:class:`~gradleak.attacks.text.dager.search.PolishConfig`);
    ``"beam"`` makes ``repair_steps`` local edits per rejected closure; ``"sample"`` evaluates up to
    ``max_samples`` sequences per length. ``end_token_id``: a token that ends every sequence ([SEP]);
    ``fill_to_batch`` completes B with the best rejected sequences (partial recovery). ``table``: evaluate
    block 1 from per-(token, position) tables where the layout allows (BERT; exact, checked against the
    model when built: :mod:`~gradleak.attacks.text.dager.block1`); False runs the model's forward for every
    sequence (the same search, slower: for comparisons). ``screen_keep`` (0: off; needs the table): of the
    candidate tokens of each beam prefix, only this many, those whose block-1 feed-forward input lies
    closest to the span of that input (read off the update's ``intermediate.dense`` gradient: the same
    identity one sublayer before block 2; used only where its rank is block 2's, as on an exact update),
    held n-grams last, go through the feed-forward layer to their block-2 score; the others are not grown
    (:meth:`L2Search.encoder_last_residuals`). 24 from MiniLM (docs/attacks-text.md, item 4's Timings: 12
    lost a WikiText-2 sentence; screening the polish's sites too was slower there). ``peel`` (``"polish"``
    on a FedSGD classifier gradient computed without dropout): as soon as the search holds a new sentence,
    its own gradient is subtracted from the update and the spans, the L1 candidates and the screen are
    re-read from what is left (:mod:`~gradleak.attacks.text.dager.peel`; a sentence that does not lower
    block 2's rank by its length under some class is not subtracted)."""

    method: str = "polish"
    per_prefix: int = 4
    repair_steps: int = 8
    rounds: int = 8
    held_ngram: int = 4
    fresh_first_words: bool = True
    novelty: float = 3.0
    screen_keep: int = 24
    polish_tries: int = 8
    polish: PolishConfig = field(default_factory=PolishConfig)
    max_samples: int = 4096
    end_token_id: int | None = None
    fill_to_batch: bool = True
    table: bool = True
    peel: bool = True

    def __post_init__(self) -> None:
        if self.method not in ("polish", "beam", "sample"):
            raise ValueError(f"method must be 'polish', 'beam' or 'sample', got {self.method!r}")
        if self.held_ngram < 0 or self.held_ngram == 1:
            raise ValueError(f"held_ngram must be 0 (off) or >= 2, got {self.held_ngram}")
        if not self.novelty >= 0:
            raise ValueError(f"novelty must be >= 0, got {self.novelty}")
        _at_least(self, 1, "per_prefix", "rounds", "polish_tries", "max_samples")
        _at_least(self, 0, "repair_steps", "screen_keep")
        if 0 < self.screen_keep < self.per_prefix:
            raise ValueError(
                f"screen_keep ({self.screen_keep}) below per_prefix ({self.per_prefix}) would cap the beam's "
                "extensions a prefix: 0 (off) or at least per_prefix"
            )


@dataclass(frozen=True)
class DagerConfig:
    """Steps 1-2 and 5 (the span tests): thresholds default (None) to the family's (see
    ``family.FAMILIES``); ``max_positions`` (sequences are at most 64 tokens, paper 002); ``vocab``
    ``"full"`` or ``"embedding"`` (scan only the embedding row-norm channel's token set);
    ``max_candidates`` per position (more means the span check is not discriminating); ``beam_width``
    prefixes kept by either search; ``repeat_tol`` rejects extensions whose block-2 input repeats the
    previous one (0: off); ``midpoint_weights`` evaluates candidates at w_0 + delta/2 (FedAvg). The
    nested ``decoder`` and ``encoder`` tables configure steps 3 and 4 (TOML: ``encoder = { end_token_id =
    102 }``). Defaults' sources (docs/attacks-text.md, "DAGER's defaults against the official code"): the
    L2 threshold 1e-3 is the official code's; the L1 threshold 1e-3 (official 1e-5) comes from the held-out
    calibration batches, where SmolLM2's true tokens reach 1.5e-5; ``rank_tol`` 1e-8 is the float32 noise
    floor of the largest singular value."""

    l1_threshold: float | None = None
    l2_threshold: float | None = None
    rank_tol: float | None = None
    max_positions: int = 64
    vocab: str = "full"
    beam_width: int = 64
    max_candidates: int = 512
    chunk: int = 4096
    repeat_tol: float = 1e-4
    midpoint_weights: bool = False
    decoder: DecoderSearch = field(default_factory=DecoderSearch)
    encoder: EncoderSearch = field(default_factory=EncoderSearch)

    def __post_init__(self) -> None:
        for name in ("l1_threshold", "l2_threshold", "rank_tol"):
            v = getattr(self, name)
            if v is not None and not 0 < v < 1:
                raise ValueError(f"{name} must be in (0, 1), got {v}")
        if self.vocab not in ("full", "embedding"):
            raise ValueError(f"vocab must be 'full' or 'embedding', got {self.vocab!r}")
        if not 0 <= self.repeat_tol < 1:
            raise ValueError(f"repeat_tol must be in [0, 1), got {self.repeat_tol}")
        _at_least(self, 1, "max_positions", "beam_width", "max_candidates", "chunk")


@dataclass(frozen=True)
class DagerFedAvgConfig(DagerConfig):
    l1_threshold: float | None = 0.05
    l2_threshold: float | None = 0.1
    midpoint_weights: bool = True


class Dager:
    """The DAGER pipeline (module docstring); reads only ``obs.model`` and ``obs.update``."""

    exact_spans = True  # the spans are exact DAGER's, so the feed-forward screen may read its own span
    peelable = True  # held sentences may be peeled off the attention inputs' gradients (``peeler``)

    def __init__(self, config: DagerConfig | None = None) -> None:
        self.config = config or DagerConfig()

    def spec(self, model: nn.Module) -> FamilySpec:
        c = self.config
        return with_thresholds(
            family_of(model), l1_threshold=c.l1_threshold, l2_threshold=c.l2_threshold, rank_tol=c.rank_tol
        )

    def attacker_model(self, obs: Observation) -> nn.Module:
        model = obs.client_model()
        return at_midpoint(model, obs) if self.config.midpoint_weights else model

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        start = time.perf_counter()
        model = self.attacker_model(obs)
        spec = self.spec(model)
        grads = [self.input_gradient(obs, model, spec, i) for i in (0, 1)]
        if float(grads[0].abs().max()) == 0.0:
            raise AttackInputError(self.zero_gradient)
        span1, span2, spec, span_stats = self.spans(obs, spec, grads[0], grads[1])
        full = self.unreadable(span1, span2, grads)
        if span1.rank == 0 or span2.rank == 0 or full:
            log.warning(
                "DAGER: the input-gradient span is %s; nothing can be recovered",
                "full rank (the input space or the gradient's columns)" if full else "empty",
            )
            stats = {"rank_l1": float(span1.rank), "span_full": float(full)}
            return Reconstruction(token_ids=[], stats={**stats, **span_stats})
        m1 = find_module(model, spec.attn_inputs[0].format(i=0))[1]
        m2 = find_module(model, spec.attn_inputs[0].format(i=1))[1]
        cands = self.position_candidates(model, spec, m1, span1, self.scan_vocab(obs, model))
        fallback: list[Scored] = []
        b = max(1, obs.update.num_samples)
        peeled, screen_rank = 0, 0
        search = self.l2_search(model, m2, span2, spec.l2_threshold, m1, generator)
        if not spec.causal and self.config.encoder.table and cands:
            end = self.config.encoder.end_token_id
            search.tabulate([*set().union(*cands), *([] if end is None else [end])], len(cands))
            if self.config.encoder.screen_keep:
                search.screen = self.feed_forward_span(obs, model, search, spec, span2)
                search.screen_keep = self.config.encoder.screen_keep
                screen_rank = search.screen.rank if search.screen is not None else 0
        if spec.causal:
            found = search.extend(cands, self.config.decoder.search, self.config.beam_width)
        elif self.config.encoder.method == "polish":
            peeler = self.peeler(obs, model, spec, search)
            repeel = None
            if peeler is not None:
                repeel = partial(self.peel_held, peeler, search, model, spec, m1)
            found, fallback = self.encoder_polish(search, cands, b, repeel)
            peeled = len(peeler.peeled) if peeler is not None else 0
        elif self.config.encoder.method == "beam":
            found, fallback = self.encoder_rounds(search, cands, b)
        else:
            found, fallback = search.encoder_search(
                cands,
                end=self.config.encoder.end_token_id,
                max_samples=self.config.encoder.max_samples,
                generator=generator,
                batch=b,
            )
        found.sort(key=lambda sr: (sr[1], -len(sr[0])))
        seqs = [s for s, _ in found[:b]]
        filled = 0
        if not spec.causal and self.config.encoder.fill_to_batch and len(seqs) < b:
            for distinct in (True, False):  # distinct sentences first, then whatever is left
                for s, _ in sorted(fallback, key=lambda sr: sr[1]):
                    if (
                        len(seqs) < b
                        and s not in seqs
                        and not (distinct and any(similar(s, q) for q in seqs))
                    ):
                        seqs.append(s)
                        filled += 1
        seqs, added = self.complete(obs, model, spec, seqs, b)
        stats = {
            **span_stats,
            "rank_l1": float(span1.rank),
            "rank_l2": float(span2.rank),
            "positions": float(len(cands)),
            "candidates": float(sum(len(c) for c in cands)),
            "accepted": float(len(found)),
            "filled": float(filled),
            "prefix_sentences": float(added),
            "screen_rank": float(screen_rank),  # before any peeling
            "peeled": float(peeled),
            "seconds": time.perf_counter() - start,
        }
        log.info("DAGER: L1 rank %d, %d positions, %d accepted sequences", span1.rank, len(cands), len(found))
        return Reconstruction(token_ids=seqs, stats=stats)

    zero_gradient = "the first block's attention gradient is zero (frozen or masked)"

    def unreadable(self, span1: Span, span2: Span, grads: list[torch.Tensor]) -> bool:
        """Whether a span fills its input space (or its gradient's columns), so the span tests cannot
        discriminate and nothing can be recovered."""
        pairs = zip((span1, span2), grads, strict=True)
        return any(span.full or self.saturated(span, grad) for span, grad in pairs)

    def saturated(self, span: Span, grad: torch.Tensor) -> bool:
        """Whether ``span`` fills the columns of the gradient it came from, so that it is a subspace of the
        inputs' span rather than that span. Off here: DAGER's full gradient has at least as many columns as
        the input space (``Span.full`` decides), and ``dager_lora``'s committed SmolLM2 results were measured
        without it (side B's v_proj is 192 wide there, below r = 256: docs/lora.md); its MiniLM rows
        (2d6033a) ran with a 0.95 x min(shape) rule that coincides with ``Span.full`` there."""
        return False

    def complete(
        self, obs: Observation, model: nn.Module, spec: FamilySpec, seqs: list[list[int]], batch: int
    ) -> tuple[list[list[int]], int]:
        """A causal LM's sequences completed with their last tokens, read off the LM head's gradient
        (:mod:`~gradleak.attacks.text.lm_completion`), after adding prefix sentences where fewer than
        ``batch`` were found; the sequences and how many were added."""
        added = 0
        if self.config.decoder.complete_last_token and spec.causal and _has_lm_head(model):
            if self.config.decoder.prefix_sentences and len(seqs) < batch:
                n = len(seqs)
                seqs = add_prefix_sentences(obs, model, seqs, batch - n, tol=self.config.decoder.prefix_tol)
                added = len(seqs) - n
            seqs = complete_last_tokens(obs, model, seqs)
        return seqs, added

    def input_gradient(
        self, obs: Observation, model: nn.Module, spec: FamilySpec, layer: int
    ) -> torch.Tensor:
        """Block ``layer``'s (d_in, k) matrix whose column space is the span of its attention inputs: the
        attention projections' weight gradients (DAGER, Petrov et al. 2024, Sec. 4)."""
        return input_side_gradient(obs, model, spec.attn_inputs, layer)

    def spans(
        self, obs: Observation, spec: FamilySpec, grad1: torch.Tensor, grad2: torch.Tensor
    ) -> tuple[Span, Span, FamilySpec, dict[str, float]]:
        """Step 1: the L1 and L2 spans from blocks 1 and 2's input-side gradients, the family spec whose
        thresholds the span tests use, and stats. Exact DAGER: the rank after the spectrum's last sharp
        drop (:func:`~gradleak.attacks.text.family.estimate_span`)."""
        return estimate_span(grad1, spec.rank_tol), estimate_span(grad2, spec.rank_tol), spec, {}

    def l2_search(
        self, model: nn.Module, m2: nn.Module, span2: Span, threshold: float, m1: nn.Module,
        generator: torch.Generator,
    ) -> L2Search:  # fmt: skip
        """Steps 3-4's search under the L2 span test."""
        c = self.config
        return L2Search(model, m2, span2, threshold, c.chunk, c.repeat_tol, m1, novelty=c.encoder.novelty)

    def feed_forward_span(
        self, obs: Observation, model: nn.Module, search: L2Search, spec: FamilySpec, span2: Span
    ) -> Span | None:
        """The span of block 1's feed-forward inputs, from its first projection's weight gradient (BERT
        layouts: ``intermediate.dense``), for the beam's screen. On an exact update it has block 2's rank
        (both count the batch's positions); None where it has not, where the update does not carry that
        gradient, or where the span fills its input space; always None for an attack whose spans are not
        exact DAGER's (``exact_spans``: a noised or sparsified gradient)."""
        key = feed_forward_weight(model, search)
        if not self.exact_spans or key is None or key not in obs.update.tensors:
            return None
        span = estimate_span(update_tensor(obs, key).T, spec.rank_tol)
        if span.full or span.rank != span2.rank:
            log.info("DAGER: no feed-forward screen (rank %d, block 2's %d)", span.rank, span2.rank)
            return None
        return span

    def peeler(self, obs: Observation, model: nn.Module, spec: FamilySpec, search: L2Search) -> Peeler | None:
        """The peeler of held sentences (``encoder.peel``; :mod:`~gradleak.attacks.text.dager.peel`) where it
        applies: exact spans of the attention inputs (``peelable``: not the noise-aware subclasses, nor
        UTR's adapter spans), one client's FedSGD gradient (not a secure-aggregation sum) computed without
        dropout, a classifier that computes its own loss, and every span's weight trainable and in the
        update; else None."""
        if not (self.config.encoder.peel and self.exact_spans and self.peelable) or obs.aggregated:
            return None
        if obs.update.kind != "gradient" or obs.mode != "eval" or not _classifies(model):
            return None
        layouts = {key: input_side_layout(model, spec.attn_inputs, i) for key, i in (("l1", 0), ("l2", 1))}
        ffn = feed_forward_weight(model, search) if search.screen is not None else None
        if ffn is not None:
            layouts["ffn"] = ((ffn, True),)
        params = dict(model.named_parameters())
        names = {n for lay in layouts.values() for n, _ in lay}
        if any(n not in obs.update.tensors or n not in params or not params[n].requires_grad for n in names):
            return None
        return Peeler.build(obs, model, layouts, spec.rank_tol)

    def peel_held(
        self,
        peeler: Peeler,
        search: L2Search,
        model: nn.Module,
        spec: FamilySpec,
        m1: nn.Module,
        held: list[list[int]],
        cands: list[list[int]],
    ) -> Repeeled | None:
        """Peel the ``held`` sentences not peeled yet; where any was, point ``search`` at the spans of what
        is left (block 2's; the feed-forward screen's while it keeps block 2's rank) and return the L1
        candidates re-read from it over ``cands``' tokens ([] where no position has any) and every
        sentence peeled so far. None where nothing new was peeled (the search is left as it was)."""
        if not peeler.peel(held):
            return None
        search.span = peeler.span("l2")
        if search.screen is not None:
            screen = peeler.span("ffn")
            search.screen = screen if screen.rank == search.span.rank else None
        scan = torch.tensor(sorted(set().union(*cands)), dtype=torch.long)
        return self.position_candidates(model, spec, m1, peeler.span("l1"), scan), list(peeler.peeled)

    def l1_test(self, span: Span, z: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2 at one position: the indices of the scanned tokens' layer-1 inputs ``z`` that pass, and
        their scores (lower is better)."""
        return span.below(z, threshold)

    def encoder_rounds(
        self, search: L2Search, cands: list[list[int]], b: int
    ) -> tuple[list[Scored], list[Scored]]:
        """Encoder beam in up to ``encoder_rounds`` rounds, then the repair of the rejected closures.

        After each round the position-1 tokens of the sentences held so far are left out of the next
        round's position-1 candidates, so the beam spends its width on the sentences still missing (a
        second sentence sharing a held one's first word is then only reachable through the repair). A
        round that finds no sentence still holds its best distinct closure (a partial recovery, repaired
        first). Stops once B sentences are held.
        """
        c = self.config
        found: list[Scored] = []
        partial: list[Scored] = []
        closures: list[Scored] = []
        for _ in range(c.encoder.rounds):
            held = [s for s, _ in found + partial]
            if len(held) >= b:
                break
            sets = list(cands)
            if len(sets) > 1:
                done = {s[1] for s in held if len(s) > 1}
                sets[1] = [v for v in sets[1] if v not in done]
                if not sets[1]:
                    break
            search.hold([q for q, _ in found])
            new, rejected = search.encoder_beam(
                sets,
                end=c.encoder.end_token_id,
                beam_width=c.beam_width,
                per_prefix=c.encoder.per_prefix,
                batch=b,
            )
            new = [sr for sr in new if sr[0] not in held]
            found += new
            closures += rejected
            if not new:
                best = next(
                    (sr for sr in rejected if len(sr[0]) > 2 and not any(similar(sr[0], q) for q in held)),
                    None,
                )
                if best is None:
                    break
                partial.append(best)
        rest = sorted((sr for sr in closures if sr not in partial), key=lambda sr: sr[1])
        found, fills = search.repair_closures(
            found,
            partial + rest,
            cands,
            end=c.encoder.end_token_id,
            batch=b,
            steps=c.encoder.repair_steps,
            tries=2 * b,
        )
        tried = {tuple(s) for s, _ in fills}
        return found, fills + [sr for sr in partial + rest if tuple(sr[0]) not in tried]

    def encoder_polish(
        self,
        search: L2Search,
        cands: list[list[int]],
        b: int,
        repeel: Callable[[list[list[int]], list[list[int]]], Repeeled | None] | None = None,
    ) -> tuple[list[Scored], list[Scored]]:
        """Encoder beam rounds whose rejected closures are polished by exact local search.

        Each round runs the prefix beam (position-1 candidates without the first words of the sentences
        held so far, nor those of rounds that found nothing; with ``fresh_first_words``, in odd rounds only
        tokens that no held sentence contains, while any are left; no ``held_ngram``-gram of a held one is
        grown), then polishes up to ``polish_tries`` of its
        best closures that are distinct from the held sentences and from every closure polished before
        (:meth:`L2Search.polish`: whole-sequence L2 residual, bidirectional context). A polished sequence
        that passes the exact check is accepted. With ``repeel`` (:meth:`peel_held`), newly held sentences
        are peeled off the update before the next polish or round: the searches after that see the
        peeled spans and candidates, without the rules that keep the search off held sentences (novelty,
        held n-grams and the polish's echo stop for the peeled ones; fresh first words and the held and
        polished sentences' first-word skips once anything is peeled): no peeled sentence is in the
        spans, and the rules would also block a missing sentence's pieces that a held one shares ("[CLS]
        it ' s" on Rotten Tomatoes); closures that echo a held sentence are not polished then. Returns the
        accepted sequences and the fills: polished sequences by objective (mean log10 residual, negative)
        first, then the unpolished closures (mean residual, positive).
        """
        c = self.config
        end, cfg = c.encoder.end_token_id, c.encoder.polish
        vocab = _inner_tokens(cands, end)
        found: list[Scored] = []
        polished: list[Scored] = []
        closures: list[Scored] = []
        tried: list[list[int]] = []
        skip: set[int] = set()
        peeled: list[list[int]] = []  # held sentences peeled off the update (``repeel``)
        polishes = 0
        # the polishes' walks (:meth:`L2Search.polish`) while ``walked`` sentences are held (a peel, which
        # changes the spans and candidates, only follows a newly held sentence)
        walks: dict[tuple[int, ...], tuple[int, Polished]] = {}
        walked = 0

        offered = 0  # held sentences offered to ``repeel`` so far

        def peel_now() -> None:
            """Peel the sentences held since the last call (none once B are held); the searches after it
            see what is left."""
            nonlocal cands, vocab, skip, tried, polishes, peeled, offered
            if repeel is None or len(found) >= b or len(found) == offered:
                return
            offered = len(found)
            out = repeel([q for q, _ in found], cands)
            if out is None:
                return
            fresh, peeled = out
            if len(fresh) >= 2:  # else keep the candidates (they hold the re-read ones) rather than none
                cands, vocab = fresh, _inner_tokens(fresh, end)
            skip, polishes, tried = set(), polishes + len(tried), []
            search.hold([q for q, _ in found if q not in peeled])  # the novelty basis in the new span

        for r in range(c.encoder.rounds):
            if len(found) >= b or len(cands) < 2:
                break
            firsts = [v for v in cands[1] if v not in skip]
            if (
                c.encoder.fresh_first_words and r % 2 == 1 and not peeled
            ):  # odd rounds: first words no held sentence contains
                used = {v for q, _ in found for v in q}
                firsts = [v for v in firsts if v not in used] or firsts
            sets = [cands[0], firsts, *cands[2:]]
            log.debug("round %d: %d held, %d first words", r, len(found), len(firsts))
            if not sets[1]:
                break
            guard = [q for q, _ in found if q not in peeled]  # a peeled sentence is in no span
            search.hold(guard)
            new, rejected = search.encoder_beam(
                sets,
                end=end,
                beam_width=c.beam_width,
                per_prefix=c.encoder.per_prefix,
                batch=b,
                held=guard,
                ngram=c.encoder.held_ngram,
            )
            new = [sr for sr in new if sr[0] not in [q for q, _ in found]]
            found += new
            closures += rejected
            gained = len(new) > 0
            for s in self._distinct_closures(rejected, found, tried):
                if len(found) >= b:
                    break
                if any(similar(s, q, 0.9) for q, _ in found):
                    continue
                peel_now()  # what this round holds so far, before polishing on
                if peeled and any(echoes(s, q, cfg.held_share) for q, _ in found):
                    continue  # grown from a held sentence, whose basin the peeled spans no longer have
                tried.append(s)
                guard = [q for q, _ in found if q not in peeled]
                if walked != len(found):  # new held sentences, maybe new spans: new walks
                    walks, walked = {}, len(found)
                p = search.polish(s, vocab, max_len=len(cands), config=cfg, held=guard, walks=walks)
                if p.worst < search.threshold and p.seq not in [q for q, _ in found]:
                    found.append((p.seq, p.worst))
                    gained = True
                elif p.worst >= search.threshold:
                    polished.append((p.seq, p.objective))
            # the next round spends its width on other first words (once peeled, not on the held or
            # polished sentences' ones: the candidates hold the missing sentences' first words only)
            if not peeled:
                skip |= {s[1] for s, _ in found if len(s) > 1} | {s[1] for s in tried}
            if not gained and rejected and len(rejected[0][0]) > 1:
                skip.add(rejected[0][0][1])
            if r < c.encoder.rounds - 1:
                peel_now()
        search.hold([])
        log.debug("encoder polish: %d accepted, %d closures polished", len(found), polishes + len(tried))
        polished.sort(key=lambda sr: sr[1])
        return found, polished + sorted(closures, key=lambda sr: sr[1])

    def _distinct_closures(
        self, rejected: list[Scored], found: list[Scored], tried: list[list[int]]
    ) -> list[list[int]]:
        """Up to ``polish_tries`` closures (best first) that are not variants of a held sentence and either
        start with a first word no polished closure had or differ from every polished one (``similar``)."""
        roots = {s[1] for s in tried}
        out: list[list[int]] = []
        for s, _ in rejected:
            if len(out) >= self.config.encoder.polish_tries:
                break
            if len(s) < 3 or any(similar(s, q, 0.9) for q, _ in found):
                continue
            if s[1] not in roots or not any(similar(s, q) for q in tried + out):
                roots.add(s[1])
                out.append(s)
        return out

    def scan_vocab(self, obs: Observation, model: nn.Module) -> torch.Tensor:
        """The token ids the L1 filter scans: the whole vocabulary, or the embedding channel's set.

        ``vocab="embedding"`` combines DAGER with paper 002's Channel 2 ("combined recovery", Sec. III-C):
        only the tokens the embedding row-norm selection keeps are scanned; the full vocabulary when the
        update lacks the embedding gradient.
        """
        rows = self.embedding_rows(obs, model) if self.config.vocab == "embedding" else None
        return torch.tensor(rows, dtype=torch.long) if rows else torch.arange(vocab_size(model))

    def embedding_rows(self, obs: Observation, model: nn.Module) -> list[int] | None:
        """The tokens the embedding row-norm channel keeps (paper 002's Channel 2), sorted, or None where the
        update lacks the embedding gradient or the channel keeps nothing."""
        name = embedding_param(model)
        if name not in obs.update.tensors:
            return None
        tokens, _ = select_rows(update_tensor(obs, name), RowNormConfig())
        return sorted(tokens) or None

    def position_candidates(
        self, model: nn.Module, spec: FamilySpec, module: nn.Module, span: Span, scan: torch.Tensor
    ) -> list[list[int]]:
        """Token ids passing the L1 check at each position 0, 1, ... (until a position has none)."""
        vocab = scan.unsqueeze(1)
        positions = self.config.max_positions if spec.positions == "learned" else 1
        out: list[list[int]] = []
        for p in bar(range(positions), desc="DAGER positions"):
            z = layer_inputs(model, module, vocab, start_position=p, chunk=self.config.chunk)[:, 0]
            ok, res = self.l1_test(span, z, spec.l1_threshold)
            if ok.numel() == 0:
                break
            if ok.numel() > self.config.max_candidates:
                ok = ok[res.argsort()[: self.config.max_candidates]]
            out.append(scan[ok].tolist())
        if spec.positions == "rotary" and out:
            out = out * self.config.max_positions
        return out


def _inner_tokens(cands: list[list[int]], end: int | None) -> list[int]:
    """The tokens the polish may put after position 0: every candidate of a later position but ``end``."""
    return sorted(set().union(*cands[1:]) - {end}) if len(cands) > 1 else []


def feed_forward_weight(model: nn.Module, search: L2Search) -> str | None:
    """The name of block 1's first feed-forward weight (BERT layouts: ``intermediate.dense``), or None."""
    layer = search.block1()
    name = next((n for n, m in model.named_modules() if m is layer), None)
    return None if layer is None or name is None else f"{name}.intermediate.dense.weight"


def _classifies(model: nn.Module) -> bool:
    try:
        return task_of(model) == "classification"
    except AttackInputError:
        return False


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
    modality="text",
)
ATTACKS.register(
    "dager_fedavg",
    DagerFedAvg,
    config_cls=DagerFedAvgConfig,
    summary="DAGER on a FedAvg pseudo-gradient (-delta, midpoint weights)",
    modality="text",
)

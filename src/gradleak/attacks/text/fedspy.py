"""FedSpy-LLM, as far as its method can be read here: the token set from the gradient, the order from
partial-sequence gradient alignment.

Meerza, Wang and Liu, "FedSpy-LLM: Towards Scalable and Generalizable Data Reconstruction Attacks from
Gradients on LLMs" (arXiv 2604.06297, 2026). Its code is not public and its method section is not available
offline: this module follows the two descriptions that are, and every choice they leave open is a
parameter, stated here and in docs/attacks-text.md. It is *our reading*, not a reproduction.

- Paper 002 (Sec. II, IV-A, VI-G): FedSpy-LLM "reads tokens from the active rows of the embedding gradient
  and resolves their order through partial-gradient alignment"; it "primarily targets Channel 2 (embedding
  row-norm sparsity) with an explicit ordering stage". ``tokens="rows"`` (default): the rows the embedding
  row-norm channel keeps (:func:`~gradleak.attacks.text.rownorm.select_rows`).
- The paper's abstract: a "gradient decomposition that exploits the rank deficiency and subspace structure
  of gradients" (the embeddings frozen, per a reader's notes of its Sec. III). ``tokens="span"``: the tokens
  whose first-block input lies in the span of block 1's attention-input gradient at some position
  (DAGER's L1 test, :mod:`~gradleak.attacks.text.family`), for updates without the embedding gradient.
  Under the next-token loss a sequence's last token is only a label, so this set lacks it. ``tokens="union"``
  takes both: under a tied head (SmolLM2) the rows miss input tokens (the head's softmax term fills every
  row; "what" and " up" of a Rotten Tomatoes sentence), the span scan over the whole vocabulary finds
  those, and the rows add the last token, which only the head's gradient holds. The union is this
  project's choice; neither source states it. Where the update does not carry block 1's attention, the
  union is the rows.
- Ordering ("iteratively aligning each token's partial-sequence gradient with the full-sequence gradient"),
  for causal language models trained on the next-token loss: each sequence grows left to right; at every
  step each token of the set is tried as the next one and the partial sequence's loss gradient g(s) (over
  the parameters the update carries) is compared with the observed gradient G by cosine; the best is kept
  while it raises the cosine by more than ``min_gain`` (with the span ends, any rise for one that passes
  block 2's test: below), up to ``max_length`` tokens. A sequence starts from
  the best-aligned pair of tokens (a single token has no next-token loss). Under causal attention a
  prefix's gradient is a partial sum of its sequence's, so the true prefix is a component of G. After a
  sequence is finished, G loses its component along g(sequence), and the next one grows against the rest
  (B = the update's sample count). Greedy (``beam`` 1) unless ``beam`` keeps more prefixes.
- Sequence ends (``ends``; paper 002 and the abstract are silent). The cosine alone does not find them: an
  extension from the rest of the batch also raises it (+0.03 measured, against +0.06 to +0.14 for true
  ones), so a sequence runs on into the next one's words. ``ends="span"`` (default) reads them off the
  same subspace structure the token stage uses: under causal attention, the block-2 input of a prefix's
  last position depends on the prefix alone, and it lies in the span of block 2's attention-input gradient
  (DAGER's L2 test, Petrov et al. 2024, Sec. 4.2) iff that position feeds the loss, i.e. iff the prefix's
  last token has a successor in some sequence of the batch (under the next-token loss the last token of a
  sequence is only a label). So a sequence starts from a token whose position-0 input passes, is extended
  only while its last token passes, and is finished when the token just added does not: that token is its
  last, a label. The same test ranks the candidates: those that pass (true prefixes) are scored, the
  others only where none passes (:meth:`FedSpy.best`). A passing extension is taken if it raises the
  cosine at all (near the end of a long SmolLM2 sentence the true one raised it by 2e-5 only, below
  ``min_gain``; a rise is still asked, so a false pass of the thresholded test that lowers the cosine ends
  the sequence); the last token, which fails, must bring ``min_gain`` (the set may lack it:
  ``tokens="span"``). Where the update does not carry
  block 2's attention (frozen, AEGIS) or its span is empty or full, the gain rule alone decides
  (``span_ends`` 0 in the stats); ``ends="gain"`` always.

Cost: under the gain rule alone, one backward pass of the model per tried token and step, ``|set|^2`` for a
start: minutes on GPT-2 small per sequence on 2 cores. With the span ranking, one per passing candidate and
``|set|`` at the last step: about 26 s a sentence there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from gradleak.attacks.image.ig import cosine_distance
from gradleak.attacks.text.dager.core import Dager, DagerConfig
from gradleak.attacks.text.family import (
    Span,
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
from gradleak.attacks.text.rownorm import RowNormConfig, select_rows
from gradleak.device import module_device
from gradleak.progress import bar
from gradleak.registry import ATTACKS
from gradleak.types import AttackInputError, AttackNeeds, Observation, Reconstruction

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FedSpyConfig:
    """``tokens`` ``"rows"`` (paper 002's reading), ``"span"`` (frozen embeddings) or ``"union"`` (both: tied
    heads, module docstring); ``rows`` the row-norm selection; ``l1_threshold`` / ``rank_tol`` the span
    test's (None: the family's, as DAGER's); ``max_length`` tokens a sequence at most; ``min_gain`` the
    cosine gain an extension must bring (with ``ends="span"``, one that fails block 2's span test: module
    docstring);
    ``beam`` prefixes kept per step; ``ends`` ``"span"`` or ``"gain"`` (module docstring); ``l2_threshold``
    the span ends' test (None: the family's, as DAGER's); ``max_tokens`` / ``max_sequences``: larger token
    sets or batches are refused before work (a start alone costs |set|^2 backward passes). None of these
    is stated by the paper: the defaults are ours."""

    tokens: str = "rows"
    rows: RowNormConfig = field(default_factory=RowNormConfig)
    l1_threshold: float | None = None
    rank_tol: float | None = None
    max_length: int = 64
    min_gain: float = 1e-4
    beam: int = 1
    ends: str = "span"
    l2_threshold: float | None = None
    max_tokens: int = 256
    max_sequences: int = 64

    def __post_init__(self) -> None:
        if self.tokens not in ("rows", "span", "union"):
            raise ValueError(f"tokens must be 'rows', 'span' or 'union', got {self.tokens!r}")
        if self.ends not in ("span", "gain"):
            raise ValueError(f"ends must be 'span' or 'gain', got {self.ends!r}")
        if self.l2_threshold is not None and not 0 < self.l2_threshold < 1:
            raise ValueError(f"l2_threshold must be in (0, 1), got {self.l2_threshold}")
        if self.max_length < 2 or self.beam < 1:
            raise ValueError(f"need max_length >= 2 and beam >= 1, got {self.max_length}, {self.beam}")
        if not 0 <= self.min_gain < float("inf"):
            raise ValueError(f"min_gain must be a finite number >= 0, got {self.min_gain}")
        if self.max_tokens < 1 or self.max_sequences < 1:
            raise ValueError("max_tokens and max_sequences must be >= 1")


class Alignment:
    """Cosine between a token sequence's next-token loss gradient and a target (the carried parameters)."""

    def __init__(self, model: nn.Module, names: list[str], target: list[torch.Tensor]) -> None:
        self.model = model
        params = dict(model.named_parameters())
        self.params = [params[n] for n in names]
        self.device = module_device(model)
        self.target = [t.to(self.device) for t in target]

    def gradient(self, ids: list[int]) -> list[torch.Tensor]:
        x = torch.tensor([ids], device=self.device)
        loss = self.model(input_ids=x, labels=x, use_cache=False).loss
        return [g.detach().double() for g in torch.autograd.grad(loss, self.params)]

    def cosine(self, ids: list[int]) -> float:
        return 1.0 - float(cosine_distance(self.gradient(ids), self.target))

    def remove(self, ids: list[int]) -> None:
        """The target without its component along the gradient of ``ids``."""
        g = self.gradient(ids)
        dot = sum(float((a * b).sum()) for a, b in zip(g, self.target, strict=True))
        norm2 = sum(float(a.square().sum()) for a in g)
        if norm2 > 0:
            self.target = [b - (dot / norm2) * a for a, b in zip(g, self.target, strict=True)]


@dataclass(frozen=True)
class SpanEnds:
    """Whether a prefix goes on (module docstring, "Sequence ends"): the block-2 input of its last position
    lies in ``span`` (block 2's attention-input span) within ``threshold``."""

    model: nn.Module
    module: nn.Module  # block 2's first attention projection
    span: Span
    threshold: float

    def continues(self, prefixes: list[list[int]]) -> list[bool]:
        """For each prefix (all of one length), whether its last token has a successor in the batch."""
        ids = torch.tensor(prefixes, device=module_device(self.model))
        z = layer_inputs(self.model, self.module, ids)[:, -1]  # no graph: capture_input runs without one
        return (self.span.residual(z) < self.threshold).tolist()


class FedSpy:
    """See the module docstring."""

    needs = AttackNeeds(update_kinds=("gradient",))

    def __init__(self, config: FedSpyConfig | None = None) -> None:
        self.config = config or FedSpyConfig()

    def token_set(self, obs: Observation, model: nn.Module) -> list[int]:
        """The tokens of the batch as ``tokens`` reads them (the first stage): the embedding rows, the span
        test, or their union."""
        c = self.config
        tokens: set[int] = set()
        if c.tokens in ("rows", "union"):
            tokens |= self.row_tokens(obs, model)
        if c.tokens == "span":
            tokens |= self.span_tokens(obs, model)
        elif c.tokens == "union":
            try:
                tokens |= self.span_tokens(obs, model)
            except AttackInputError as err:  # block 1's attention is not in the update: the rows alone
                log.info("FedSpy-LLM: no span scan (%s); the embedding rows alone", err)
        return sorted(tokens)

    def row_tokens(self, obs: Observation, model: nn.Module) -> set[int]:
        """The rows the embedding row-norm channel keeps (paper 002's reading)."""
        name = embedding_param(model)
        if name not in obs.update.tensors:
            raise AttackInputError(
                f"tokens={self.config.tokens!r} reads the embedding gradient, which this update does not "
                "carry (frozen embeddings): use tokens='span'"
            )
        tokens, _ = select_rows(update_tensor(obs, name), self.config.rows)
        return set(tokens)

    def span_tokens(self, obs: Observation, model: nn.Module) -> set[int]:
        """The vocabulary's tokens whose first-block input passes DAGER's L1 test at some position; none
        where block 1's span is empty or full; refused where the update does not carry block 1's
        attention."""
        c = self.config
        spec = with_thresholds(family_of(model), l1_threshold=c.l1_threshold, rank_tol=c.rank_tol)
        span = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 0), spec.rank_tol)
        if span.rank == 0 or span.full:
            return set()
        m1 = find_module(model, spec.attn_inputs[0].format(i=0))[1]
        dager = Dager(DagerConfig(l1_threshold=spec.l1_threshold, max_positions=c.max_length))
        cands = dager.position_candidates(model, spec, m1, span, torch.arange(vocab_size(model)))
        return set().union(*cands) if cands else set()

    def reconstruct(self, obs: Observation, *, generator: torch.Generator) -> Reconstruction:
        start = time.perf_counter()
        model = obs.client_model()
        if not family_of(model).causal or not hasattr(model, "lm_head"):
            raise AttackInputError(
                "FedSpy-LLM's ordering aligns next-token loss gradients: it needs a causal language model "
                "trained on its own next tokens"
            )
        if obs.update.kind != "gradient":
            raise AttackInputError("FedSpy-LLM aligns one FedSGD gradient; this update is a FedAvg delta")
        names = [n for n, _ in model.named_parameters() if n in obs.update.tensors]
        if not names:
            raise AttackInputError("the update carries none of the model's parameters")
        for p in model.parameters():
            p.requires_grad_(False)
        for n, p in model.named_parameters():
            if n in obs.update.tensors:
                p.requires_grad_(True)
        tokens = self.token_set(obs, model)
        count = max(1, obs.update.num_samples)
        if len(tokens) > self.config.max_tokens or count > self.config.max_sequences:
            raise AttackInputError(
                f"FedSpy-LLM: {len(tokens)} tokens and {count} sequences (at most {self.config.max_tokens} "
                f"and {self.config.max_sequences}: a start alone is {len(tokens) ** 2} backward passes); "
                "raise max_tokens / max_sequences to run it anyway"
            )
        align = Alignment(model, names, [update_tensor(obs, n) for n in names])
        ends = self.span_ends(obs, model) if tokens else None
        seqs: list[list[int]] = []
        scores: list[float] = []
        if tokens:
            for _ in bar(range(count), desc="FedSpy-LLM sequences"):
                seq, score = self.grow(align, tokens, ends, seqs)
                seqs.append(seq)
                scores.append(score)
                align.remove(seq)
        stats = {"tokens": float(len(tokens)), "alignment": sum(scores) / max(1, len(scores)),
                 "span_ends": float(ends is not None), "seconds": time.perf_counter() - start}  # fmt: skip
        return Reconstruction(token_ids=seqs, stats=stats)

    def span_ends(self, obs: Observation, model: nn.Module) -> SpanEnds | None:
        """The span test of sequence ends (module docstring), or None where ``ends="gain"`` or the update
        does not show block 2's span (not carried, empty or full)."""
        if self.config.ends != "span":
            return None
        spec = with_thresholds(
            family_of(model), l2_threshold=self.config.l2_threshold, rank_tol=self.config.rank_tol
        )
        try:
            span = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
        except AttackInputError:  # block 2's attention is not in the update (frozen)
            span = None
        if span is None or span.rank == 0 or span.full:
            log.info(
                "FedSpy-LLM: block 2's attention span is not readable; the gain rule alone ends sequences"
            )
            return None
        module = find_module(model, spec.attn_inputs[0].format(i=1))[1]
        return SpanEnds(model, module, span, spec.l2_threshold)

    def grow(
        self,
        align: Alignment,
        tokens: list[int],
        ends: SpanEnds | None = None,
        done: Sequence[list[int]] = (),
    ) -> tuple[list[int], float]:
        """One sequence: the best-aligned pair, then extensions while they raise the cosine by ``min_gain``
        (any rise, for one that passes the span test: module docstring) and, with ``ends``, while the
        prefix's last token has a successor; with
        ``ends`` the first token is one whose position-0 input passes (all tokens if none does), and
        candidates that pass the span test come first unless they are prefixes of the sequences ``done``
        (:meth:`best`)."""
        c = self.config
        firsts = tokens
        if ends is not None:
            firsts = [a for a, ok in zip(tokens, ends.continues([[a] for a in tokens]), strict=True) if ok]
            firsts = firsts or tokens
        beam, _ = self.best(align, [[a, b] for a in firsts for b in tokens], ends, done)
        best = beam[0]
        while len(best[0]) < c.max_length:
            live = [s for s, _ in beam]
            if ends is not None:
                live = [s for s, ok in zip(live, ends.continues(live), strict=True) if ok]
            if not live:
                break
            grown = [s + [v] for s in live for v in tokens]
            beam, passed = self.best(align, grown, ends, done)
            if beam[0][1] <= best[1] + (0.0 if passed else c.min_gain):
                break  # a passing extension (a true prefix) needs any rise, others min_gain
            best = beam[0]
        return best

    def best(
        self,
        align: Alignment,
        cands: list[list[int]],
        ends: SpanEnds | None,
        done: Sequence[list[int]] = (),
    ) -> tuple[list[tuple[list[int], float]], bool]:
        """The ``beam`` best of ``cands`` (all of one length) by cosine, and whether they pass the span test.
        With ``ends``, only the candidates whose last token has a successor are scored where any is: under
        causal attention the span test passes exactly for true prefixes of the batch's sequences (DAGER's L2
        test; thresholded, so a false pass at a large B could still win), so a wrong token is not chosen over
        a true continuation. With ``beam`` > 1 the beam then holds passing candidates only. Prefixes of the
        sequences ``done`` (already recovered: their gradient left the target) do not count as passing, so the
        next sequence is not pushed back into them. Only where no candidate passes are the others scored (a
        sequence's last token, a label, fails the test): the best by cosine then ends the sequence. Before,
        the cosine alone chose, and on a WikiText-2 sentence a wrong second token (failing the test, so read
        as the end) ended it after two tokens. Scoring the passing candidates first also saves most of the
        backward passes."""
        k = self.config.beam
        cosine: dict[int, float] = {}

        def ranked(idx: list[int]) -> list[tuple[list[int], float]]:
            for i in idx:
                if i not in cosine:
                    cosine[i] = align.cosine(cands[i])
            top = sorted(idx, key=lambda i: -cosine[i])[:k]
            return [(cands[i], cosine[i]) for i in top]

        if ends is not None:
            old = {tuple(d[: len(cands[0])]) for d in done}
            passing = [i for i, ok in enumerate(ends.continues(cands)) if ok and tuple(cands[i]) not in old]
            if passing:
                return ranked(passing), True
        return ranked(list(range(len(cands)))), False


ATTACKS.register(
    "fedspy",
    FedSpy,
    config_cls=FedSpyConfig,
    summary="FedSpy-LLM as read here: tokens from the gradient, order by partial-gradient alignment",
    modality="text",
)

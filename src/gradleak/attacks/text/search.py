"""DAGER's sequence search under the block-2 span check (Petrov et al., NeurIPS 2024, Sec. 4.2-4.3).

:class:`L2Search` holds the attacker's model, the block-2 projection whose input is checked, the L2 span
and its threshold. Decoders grow prefixes left to right (:meth:`L2Search.extend`; each extension's
residual comes from one cached forward of the prefixes plus one token per candidate); encoders search
whole sequences per length (:meth:`L2Search.encoder_search`), exhaustively or by sampled coordinate
descent.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from gradleak.attacks.text.family import Span, capture_input, layer_inputs

log = logging.getLogger(__name__)

Scored = tuple[list[int], float]  # a token sequence and its (max) L2 residual


@dataclass
class L2Search:
    model: nn.Module
    module: nn.Module  # block 2's first attention projection
    span: Span
    threshold: float
    chunk: int = 4096
    repeat_tol: float = 1e-4  # decoders: an extension whose block-2 input repeats the previous one

    def residual(self, seqs: torch.Tensor, last_only: bool, reduce: str = "max") -> torch.Tensor:
        """L2 residual of each sequence's last token, or its max / mean over the positions."""
        z = layer_inputs(self.model, self.module, seqs, chunk=max(1, self.chunk // seqs.shape[1]))
        res = self.span.residual(z[:, -1] if last_only else z)
        if last_only:
            return res
        return res.max(dim=1).values if reduce == "max" else res.mean(dim=1)

    def extend(self, cands: list[list[int]], search: str, beam_width: int) -> list[Scored]:
        """Decoder search: grow prefixes token by token under the L2 check (DAGER step 3)."""
        if not cands:
            return []
        # first tokens: under causal attention their block-2 input depends on themselves only
        first = self.residual(torch.tensor(cands[0]).unsqueeze(1), last_only=True)
        live = [([v], float(r)) for v, r in zip(cands[0], first, strict=True) if r < self.threshold]
        done: list[Scored] = []
        for p in range(1, len(cands) + 1):
            if not live:
                break
            if p == len(cands):
                done += live
                break
            pairs = [(s, v) for s, _ in live for v in cands[p]]
            group = max(1, self.chunk // (8 * len(cands[p])))
            res = torch.cat(
                [
                    self.extension_residuals([s for s, _ in live[i : i + group]], cands[p])
                    for i in range(0, len(live), group)
                ]
            )
            nxt: list[Scored] = []
            for s, r in live:
                idx = [i for i, (q, _) in enumerate(pairs) if q is s and res[i] < self.threshold]
                if not idx:
                    done.append((s, r))
                    continue
                idx.sort(key=lambda i: float(res[i]))
                keep = idx[:1] if search == "greedy" else idx
                nxt += [(pairs[i][0] + [pairs[i][1]], max(r, float(res[i]))) for i in keep]
            nxt.sort(key=lambda sr: sr[1])
            live = nxt[:beam_width]
        return done

    def extension_residuals(self, prefixes: list[list[int]], cands: list[int]) -> torch.Tensor:
        """L2 residual of the last token of ``s + [v]`` for each prefix s (outer) and candidate v (inner).

        Extensions whose block-2 input repeats the prefix's last one (relative distance below
        ``repeat_tol``) get residual ``inf``: they add no new direction, so the span cannot confirm them.
        Under rotary (position-free) attention a run of one token [a, a, ...] has the same block-2 input at
        every position (the values are all a's, whatever the attention weights), so without this rule
        every first token a grows an accepted run a, a, a, ... next to its true continuation.

        The prefixes (all of one length) run once through block 1 into a key/value cache that every
        candidate reuses (one token each); without a usable cache whole sequences are recomputed (same
        result).
        """
        model, module = self.model, self.module
        n, t = len(prefixes), len(prefixes[0])
        ids = torch.tensor(cands).repeat(n).unsqueeze(1)
        try:
            from transformers import DynamicCache

            cache = DynamicCache()
            # transformers >= 5.x names the argument `cache` (`past_key_values` is deprecated)
            key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            zp = capture_input(
                model, module, input_ids=torch.tensor(prefixes), use_cache=True, **{key: cache}
            )
            cache.batch_repeat_interleave(len(cands))
            pos = torch.full((n * len(cands), 1), t)
            z = capture_input(model, module, input_ids=ids, use_cache=True, position_ids=pos, **{key: cache})
            z, prev = z[:, -1], zp[:, -1].repeat_interleave(len(cands), dim=0)
        except (ImportError, TypeError, AttributeError, RuntimeError, ValueError) as err:
            log.debug("no KV-cache fast path (%s); recomputing whole prefixes", err)
            seqs = torch.cat([torch.tensor(prefixes).repeat_interleave(len(cands), dim=0), ids], dim=1)
            zz = layer_inputs(self.model, self.module, seqs, chunk=max(1, self.chunk // seqs.shape[1]))
            z, prev = zz[:, -1], zz[:, -2]
        res = self.span.residual(z)
        z64 = z.to(torch.float64)
        repeat = (z64 - prev.to(torch.float64)).norm(dim=-1) < self.repeat_tol * z64.norm(dim=-1)
        return torch.where(repeat, torch.full_like(res, float("inf")), res)

    def encoder_search(
        self,
        cands: list[list[int]],
        *,
        end: int | None,
        max_samples: int,
        generator: torch.Generator,
        batch: int = 1,
    ) -> tuple[list[Scored], list[Scored]]:
        """Accepted sequences and the ``batch`` best of each searched length (DAGER step 4)."""
        found: list[Scored] = []
        fallback: list[Scored] = []
        for length in range(1, len(cands) + 1):
            if end is not None and end not in cands[length - 1]:
                continue
            sets = cands[:length]
            if end is not None:
                sets = [*sets[:-1], [end]]
            total = 1
            for c in sets:
                total *= len(c)
            if total <= max_samples:
                seqs = torch.tensor(list(itertools.product(*sets)))
            else:
                seqs = self.refined_samples(sets, max_samples, generator)
            res = self.residual(seqs, last_only=False)
            for i in torch.nonzero(res < self.threshold).flatten().tolist():
                found.append((seqs[i].tolist(), float(res[i])))
            for i in res.argsort()[:batch].tolist():
                fallback.append((seqs[i].tolist(), float(res[i])))
        return found, fallback

    def refined_samples(
        self, sets: list[list[int]], max_samples: int, generator: torch.Generator
    ) -> torch.Tensor:
        """Random candidate sequences, each improved by coordinate descent on the mean L2 residual."""
        n = max(2, max_samples // (4 * sum(len(c) for c in sets)))
        draws = torch.stack(
            [torch.tensor(c)[torch.randint(len(c), (n,), generator=generator)] for c in sets], dim=1
        )
        for _ in range(2):
            for p, c in enumerate(sets):
                if len(c) == 1:
                    continue
                trial = draws.repeat_interleave(len(c), dim=0)
                trial[:, p] = torch.tensor(c).repeat(draws.shape[0])
                res = self.residual(trial, last_only=False, reduce="mean")
                res = res.view(-1, len(c))
                draws[:, p] = torch.tensor(c)[res.argmin(dim=1)]
        return torch.unique(draws, dim=0)

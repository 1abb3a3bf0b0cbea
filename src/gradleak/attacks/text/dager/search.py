"""DAGER's sequence search under the block-2 span check (Petrov et al., NeurIPS 2024, Sec. 4.2-4.3).

:class:`L2Search` holds the attacker's model, the block-2 projection whose input is checked, the L2 span
and its threshold. Decoders grow prefixes left to right (:meth:`L2Search.extend`; each extension's
residual comes from one cached forward of the prefixes plus one token per candidate); encoders search
whole sequences: a prefix beam (:meth:`L2Search.encoder_beam`) whose closures are polished by exact local
search (:meth:`L2Search.polish`), or per length (:meth:`L2Search.encoder_search`), exhaustively or by
sampled coordinate descent.
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradleak.attacks.text.dager.block1 import (
    Block1Table,
    attend_heads,
    attention_output,
    feed_forward,
    finish,
)
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
    first: nn.Module | None = None  # block 1's first attention projection (encoder beam: layer-1 inputs)
    novelty: float = 0.0  # encoder beam: weight of the novelty factor in the prefix score (see ``hold``)
    screen: Span | None = None  # encoder beam: block 1's feed-forward input span (``encoder_last_residuals``)
    screen_keep: int = 0  # encoder beam: extensions a prefix the feed-forward screen keeps (0: no screen)
    _held: torch.Tensor | None = None  # orthonormal basis (span coordinates) of the held block-2 inputs
    _fast: bool | None = None  # encoder beam: the one-token block-1 fast path agrees with the model
    _table: Block1Table | None = None  # encoders: block 1 from per-(token, position) tables (``tabulate``)

    def tabulate(self, tokens: Sequence[int], length: int) -> None:
        """Evaluate block 1 from tables of ``tokens`` at positions ``0 .. length - 1`` from now on
        (:class:`~gradleak.attacks.text.dager.block1.Block1Table`: BERT layouts, checked against the model
        when built). Where the table does not cover a sequence, or the layout is not BERT's, whole sequences
        run through the model's forward, and the prefix beam's and site screens' one-query steps through
        :func:`_bert_site` on the model's own layer-1 inputs."""
        layer = self.block1()
        if layer is not None and self.first is not None:
            self._table = Block1Table.build(self.model, self.first, self.module, layer, list(tokens), length)
        log.debug("block-1 table: %s", "used" if self._table is not None else "not used")

    def block2_inputs(self, seqs: torch.Tensor) -> torch.Tensor:
        """Block-2 inputs (n, L, d) of the whole sequences ``seqs`` (n, L)."""
        if self._table is not None and self._table.covers(seqs):
            return self._table.whole(seqs, self.chunk)
        return layer_inputs(self.model, self.module, seqs, chunk=max(1, self.chunk // seqs.shape[1]))

    def residual(self, seqs: torch.Tensor, last_only: bool, reduce: str = "max") -> torch.Tensor:
        """L2 residual of each sequence's last token, or its max / mean over the positions."""
        z = self.block2_inputs(seqs)
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
        z, prev = self.extension_inputs(prefixes, cands)
        res = self.span.residual(z)
        return torch.where(self.repeats(z, prev), torch.full_like(res, float("inf")), res)

    def repeats(self, z: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Whether each block-2 input ``z`` repeats the previous position's ``prev`` (``repeat_tol``)."""
        z64 = z.to(torch.float64)
        return (z64 - prev.to(torch.float64)).norm(dim=-1) < self.repeat_tol * z64.norm(dim=-1)

    def extension_inputs(
        self, prefixes: list[list[int]], cands: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block-2 inputs of the last token of ``s + [v]`` (prefix outer, candidate inner) and of the
        last token of ``s`` (repeated per candidate), from one cached forward of the prefixes."""
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
            zz = self.block2_inputs(seqs)
            z, prev = zz[:, -1], zz[:, -2]
        return z, prev

    def hold(self, held: Sequence[list[int]]) -> None:
        """Record the held (recovered) sentences for the novelty factor of :meth:`prefix_score`.

        The block-2 inputs of a held sentence are known exactly, and they span a subspace H of the L2 span S.
        The sentences still missing have inputs in S that are not echoes of H, while a beam that re-grows
        pieces of held sentences (their local contexts) produces inputs close to H.
        """
        if not held or self.novelty == 0:
            self._held = None
            return
        z = torch.cat(self.whole_inputs(list(held)))
        c = z.to(torch.float64) @ self.span.basis
        u, sv, _ = torch.linalg.svd(c.T, full_matrices=False)
        self._held = u[:, sv > 1e-6 * sv.max()]

    def novel_fraction(self, z: torch.Tensor) -> torch.Tensor:
        """Fraction ||P_U z|| / ||P_S z|| of each row's in-span part that lies outside the held subspace H."""
        assert self._held is not None
        c = z.to(torch.float64) @ self.span.basis
        u = c - (c @ self._held) @ self._held.T
        return u.norm(dim=-1) / c.norm(dim=-1).clamp_min(1e-30)

    def prefix_score(self, z: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
        """L2 residual of each row (``res`` when already computed), times exp(-novelty * novel fraction)
        once sentences are held."""
        res = self.span.residual(z) if res is None else res
        if self._held is None:
            return res
        return res * torch.exp(-self.novelty * self.novel_fraction(z))

    def encoder_beam(
        self,
        cands: list[list[int]],
        *,
        end: int | None,
        beam_width: int,
        per_prefix: int,
        batch: int = 1,
        held: Sequence[list[int]] = (),
        ngram: int = 4,
    ) -> tuple[list[Scored], list[Scored]]:
        """Encoder search: grow prefixes left to right under a prefix-only L2 score (default encoder path).

        Under bidirectional attention a position's block-2 input depends on the whole sequence, so a prefix
        has no exact check. It still has a good approximate one: block 1 of a trained encoder attends
        mostly near each position, so the block-2 input of the last token of ``s + [v]``, computed from
        the prefix alone (no right context), is closest to the span for the true v (typically rank 0-3
        of ~100 batch tokens on all-MiniLM-L6-v2). Each prefix keeps its ``per_prefix`` best extensions
        (more while the beam is not full, at most ``screen_keep`` under the feed-forward screen), the beam
        keeps the ``beam_width`` prefixes with the smallest summed score, and every prefix is also closed
        (with ``end_token_id``, e.g. [SEP], when given) and checked exactly: a closed sequence is
        accepted iff all its block-2 inputs lie in the L2 span.
        Extensions that would complete an ``ngram``-gram of a ``held`` sentence (already recovered) are
        not grown: without right context the prefix score favours a held sentence's continuation after any
        first word, so later rounds would otherwise fill the beam with its variants (``ngram`` 0: off).
        Prefixes, extensions and rejected closures are ranked by :meth:`prefix_score` (the L2 residual,
        novelty-weighted once sentences are held); acceptance is the exact check on the plain residual.
        Returns the accepted sequences and the best rejected closures (lowest mean score first).
        """
        blocked = held_ngrams(held, ngram)
        found: list[Scored] = []
        closures: list[Scored] = []
        live: list[Scored] = [([v], 0.0) for v in cands[0]]
        for p in range(1, len(cands) + 1):
            if not live:
                break
            closed = [s + [end] for s, _ in live] if end is not None else [s for s, _ in live]
            if end is None or (p < len(cands) and end in cands[p]):
                seqs = torch.tensor(closed)
                z = self.block2_inputs(seqs)
                res = self.span.residual(z)
                worst, mean = res.max(dim=1).values, self.prefix_score(z, res).mean(dim=1)
                for i, seq in enumerate(closed):
                    if worst[i] < self.threshold:
                        found.append((seq, float(worst[i])))
                    else:
                        closures.append((seq, float(mean[i])))
            if p == len(cands):
                break
            choices = [v for v in cands[p] if v != end]
            if not choices:
                break
            k = min(len(choices), max(per_prefix, -(-beam_width // len(live))))
            mask = None
            if blocked:
                mask = torch.tensor(
                    [[(*s[-(ngram - 1) :], v) in blocked for v in choices] for s, _ in live], dtype=torch.bool
                )
            scores = self.encoder_last_residuals([s for s, _ in live], choices, p, blocked=mask)
            if mask is not None:
                scores[mask] = float("inf")
            top = scores.topk(k, dim=1, largest=False)
            grown = [
                s + [choices[j]]
                for (s, _), row, val in zip(live, top.indices.tolist(), top.values.tolist(), strict=True)
                for j, r in zip(row, val, strict=True)
                if r != float("inf")
            ]
            if not grown:
                break
            live = self.diverse_beam(grown, beam_width, max(1, beam_width // max(1, batch)))
        closures.sort(key=lambda sr: sr[1])
        return found, closures[: 64 * max(1, batch)]

    def repair_closures(
        self,
        found: list[Scored],
        closures: list[Scored],
        cands: list[list[int]],
        *,
        end: int | None,
        batch: int,
        steps: int,
        tries: int,
    ) -> tuple[list[Scored], list[Scored]]:
        """Repair the best distinct rejected closures by local edits until B sequences are held.

        Returns the accepted sequences (``found`` plus the repaired ones that pass the exact check) and the
        rest of the repaired closures (partial recoveries, lowest mean residual first).
        """
        vocab = sorted(set().union(*cands[1:]) - {end}) if len(cands) > 1 else []
        found = list(found)
        have = [s for s, _ in found]
        fills: list[Scored] = []
        done = 0
        for s, _ in closures:
            if len(have) + len(fills) >= batch or done >= tries or not vocab:
                break
            if any(similar(s, q) for q in have + [f for f, _ in fills]):
                continue
            done += 1
            seq, worst, mean = self.repair(s, vocab, steps, max_len=len(cands))
            if worst < self.threshold and seq not in have:
                found.append((seq, worst))
                have.append(seq)
            elif not any(similar(seq, q) for q in have + [f for f, _ in fills]):
                fills.append((seq, mean))
        log.debug("encoder repair: %d closures tried, %d accepted", done, len(found))
        return found, sorted(fills, key=lambda sr: sr[1])

    def repair(
        self, seq: list[int], vocab: list[int], steps: int, *, max_len: int
    ) -> tuple[list[int], float, float]:
        """Greedy local search on a whole sequence: around the two positions with the largest L2 residual
        (and before the last token: truncated variants) substitute, delete, insert a batch token or move
        the token elsewhere, keeping the edit that most lowers the mean residual, for up to ``steps``
        edits; the first and last tokens ([CLS], [SEP]) stay. Returns the sequence, its max and mean
        residual."""

        def scores(seqs: list[list[int]]) -> torch.Tensor:
            out = torch.empty(len(seqs), dtype=torch.float64)
            for idx in length_groups(seqs):
                t = torch.tensor([seqs[i] for i in idx])
                z = self.block2_inputs(t)
                out[idx] = self.span.residual(z).mean(dim=1)
            return out

        cur = list(seq)
        res = self.span.residual(self.block2_inputs(torch.tensor([cur])))[0]
        best = float(res.mean())
        for _ in range(steps):
            if float(res.max()) < self.threshold or len(cur) < 3:
                break
            inner = sorted(range(1, len(cur) - 1), key=lambda i: -float(res[i]))[:2]
            pos = sorted(
                {q for i in inner for q in (i - 1, i, i + 1) if 1 <= q < len(cur) - 1} | {len(cur) - 2}
            )
            trials: list[list[int]] = []
            for q in pos:
                trials += [[*cur[:q], v, *cur[q + 1 :]] for v in vocab if v != cur[q]]
                trials.append([*cur[:q], *cur[q + 1 :]])
                rest = [*cur[:q], *cur[q + 1 :]]
                trials += [[*rest[:j], cur[q], *rest[j:]] for j in range(1, len(cur) - 1) if j != q]
                if len(cur) < max_len:
                    trials += [[*cur[:q], v, *cur[q:]] for v in vocab]
                    trials += [[*cur[: q + 1], v, *cur[q + 1 :]] for v in vocab]
            sc = scores(trials)
            i = int(sc.argmin())
            if float(sc[i]) >= best:
                break
            cur, best = trials[i], float(sc[i])
            res = self.span.residual(self.block2_inputs(torch.tensor([cur])))[0]
        return cur, float(res.max()), float(res.mean())

    def diverse_beam(self, prefixes: list[list[int]], beam_width: int, per_root: int) -> list[Scored]:
        """The ``beam_width`` prefixes with the smallest mean L2 residual (each prefix on its own), at most
        ``per_root`` sharing a token at position 1, so that no one sequence's variants fill the beam."""
        seqs = torch.tensor(prefixes)
        z = self.block2_inputs(seqs)
        mean = self.prefix_score(z)[:, 1:].mean(dim=1)
        out: list[Scored] = []
        count: dict[int, int] = {}
        for i in mean.argsort().tolist():
            root = prefixes[i][1]
            if count.get(root, 0) < per_root:
                count[root] = count.get(root, 0) + 1
                out.append((prefixes[i], float(mean[i])))
                if len(out) == beam_width:
                    break
        return out

    def encoder_last_residuals(
        self,
        prefixes: list[list[int]],
        cands: list[int],
        t: int,
        *,
        blocked: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(n, c): L2 residual of the last token of ``s + [v]`` computed on that sequence alone.

        With a ``screen`` (the span of block 1's feed-forward input, from its first projection's weight
        gradient: the same identity one sublayer earlier) and the block-1 table, only the ``screen_keep``
        extensions of each prefix whose feed-forward input lies closest to that span, ``blocked`` ones
        (n, c) last, go through the feed-forward layer and get a score; the others score inf (not grown).
        The feed-forward layer is most of the work per evaluated token. (Keeping at least the beam's
        per-prefix quota instead, 64 at the first position, lost a WikiText-2 sentence and took 185 s
        against 96 s: docs/attacks-text.md, item 4's Timings.)
        """
        out = []
        group = max(1, 4 * self.chunk // max(1, len(cands) * t))
        for i in range(0, len(prefixes), group):
            part = prefixes[i : i + group]
            held = None if blocked is None else blocked[i : i + group]
            screened = self._screened_last(part, cands, t, held)
            if screened is not None:
                out.append(screened)
                continue
            z = self._encoder_last_inputs(part, cands, t)
            out.append(self.prefix_score(z).view(len(part), len(cands)))
        return torch.cat(out)

    @torch.no_grad()
    def _screened_last(
        self, prefixes: list[list[int]], cands: list[int], t: int, blocked: torch.Tensor | None
    ) -> torch.Tensor | None:
        """:meth:`encoder_last_residuals` of one group under the feed-forward screen, or None where it does
        not apply (no screen, no table for these tokens, or no more candidates than it keeps)."""
        layer, keep = self.block1(), self.screen_keep
        if self.screen is None or not 0 < keep < len(cands) or layer is None:
            return None
        table = self._site_table(prefixes, cands, t)
        if table is None:
            return None
        heads, z1 = table.site_heads(torch.tensor(prefixes), torch.arange(t), torch.tensor(cands), t)
        a = attention_output(layer, heads, z1)  # (n, c, d): the feed-forward inputs
        rank = self.screen.residual_squared32(a)
        if blocked is not None:
            rank[blocked] = float("inf")
        pick = rank.topk(keep, dim=1, largest=False).indices
        picked = a.gather(1, pick.unsqueeze(-1).expand(-1, -1, a.shape[-1]))
        score = self.prefix_score(feed_forward(layer, picked).reshape(-1, a.shape[-1]))
        out = torch.full((len(prefixes), len(cands)), float("inf"), dtype=score.dtype)
        return out.scatter_(1, pick, score.view(len(prefixes), -1))

    def _encoder_last_inputs(self, prefixes: list[list[int]], cands: list[int], t: int) -> torch.Tensor:
        """Block-2 inputs (n * c, d) of the last token of each ``s + [v]``.

        Fast path (BERT-style post-LN layers): block 1's keys and values of the prefix positions depend on
        their own layer-1 inputs only, so one query token per candidate attends over them; checked once
        against the full forward, else whole sequences are recomputed.
        """
        layer = self.block1()
        if layer is not None and self._fast is not False:
            z = self._bert_last(layer, prefixes, cands, t)
            if self._fast is None:
                ref = self._full_last(prefixes[:2], cands[:4])
                got = z.view(len(prefixes), len(cands), -1)[:2, :4].reshape(ref.shape)
                err = float((got - ref).norm() / ref.norm())
                self._fast = err < 1e-4
                log.debug("encoder fast path relative error %.1e (used: %s)", err, self._fast)
            if self._fast:
                return z
        return self._full_last(prefixes, cands)

    def _full_last(self, prefixes: list[list[int]], cands: list[int]) -> torch.Tensor:
        n, c = len(prefixes), len(cands)
        ids = torch.tensor(cands).repeat(n).unsqueeze(1)
        seqs = torch.cat([torch.tensor(prefixes).repeat_interleave(c, dim=0), ids], dim=1)
        return layer_inputs(self.model, self.module, seqs, chunk=max(1, self.chunk // seqs.shape[1]))[:, -1]

    def block1(self) -> nn.Module | None:
        """Block 1 (the layer holding ``first``) when it has the BERT layout, else None."""
        if self.first is None:
            return None
        for name, mod in self.model.named_modules():
            if mod is self.first and name.endswith(".attention.self.query"):
                layer = self.model.get_submodule(name[: -len(".attention.self.query")])
                if all(hasattr(layer, a) for a in ("attention", "intermediate", "output")):
                    return layer
        return None

    @torch.no_grad()
    def _bert_last(self, layer: Any, prefixes: list[list[int]], cands: list[int], t: int) -> torch.Tensor:
        assert self.first is not None
        n, c = len(prefixes), len(cands)
        table = self._site_table(prefixes, cands, t)
        if table is not None:
            z = table.site(torch.tensor(prefixes), torch.arange(t), torch.tensor(cands), t)
            return z.reshape(n * c, -1)
        zp = layer_inputs(self.model, self.first, torch.tensor(prefixes))  # (n, t, d), context-free
        zc = layer_inputs(self.model, self.first, torch.tensor(cands).unsqueeze(1), start_position=t)[:, 0]
        return _bert_site(layer, zp, zc).reshape(n * c, -1)

    @torch.no_grad()
    def site_residuals(
        self, seq: list[int], vocab: list[int], sites: list[int], insert: bool
    ) -> torch.Tensor:
        """(len(sites), len(vocab)): L2 residual at position i of ``seq`` with token v put at i, with the
        whole sequence around it as context (``insert``: v inserted before ``seq[i]``, the rest shifted),
        in float32 (:meth:`Span.residual32`): a screen that ranks candidates, never a pass/fail test.

        It is taken of the exact block-2 input of position i of the edited sequence (bidirectional
        attention over every other position), so on a mostly right sequence the true token ranks first at
        each position, unlike the prefix-only score. BERT layouts use the one-query fast path of
        :meth:`_bert_last`; other models recompute the edited sequences.
        """
        if not sites:
            return torch.empty(0, len(vocab), dtype=torch.float32)
        layer = self.block1()
        if layer is not None and self._fast is None:
            self._encoder_last_inputs([seq[:2]], vocab[:4], 2)  # checks the fast path once
        if layer is None or self._fast is False:
            return torch.stack([self._site_full(seq, vocab, i, insert) for i in sites])
        assert self.first is not None
        table = self._site_table([seq], vocab, len(seq) - 1 + insert)
        if table is not None:
            return self._table_sites(table, seq, vocab, sites, insert)
        z1 = layer_inputs(self.model, self.first, torch.tensor([seq]))[0]  # context-free layer-1 inputs
        # insert: seq[j] for j >= i moves to position j + 1 (layer-1 input of seq[j] at j + 1)
        z1s = layer_inputs(self.model, self.first, torch.tensor([seq[:1] + seq]))[0][1:] if insert else z1
        vocab_ids = torch.tensor(vocab).unsqueeze(1)
        out = []
        for i in sites:
            ctx = torch.cat([z1[:i], z1s[i:] if insert else z1[i + 1 :]]).unsqueeze(0)
            zc = layer_inputs(self.model, self.first, vocab_ids, start_position=i)[:, 0]
            out.append(self.span.residual32(_bert_site(layer, ctx, zc)[0]))
        return torch.stack(out)

    def _site_table(self, ctx: list[list[int]], cands: list[int], top: int) -> Block1Table | None:
        """The block-1 table where it holds every token of ``ctx`` and ``cands`` at positions <= ``top``."""
        table = self._table
        ok = table is not None and top < table.length and table.has(ctx) and table.has(cands)
        return table if ok else None

    def _table_sites(
        self, table: Block1Table, seq: list[int], vocab: list[int], sites: list[int], insert: bool
    ) -> torch.Tensor:
        """:meth:`site_residuals` from the block-1 table, the sites in as few calls as ``chunk`` allows
        (one for a MiniLM batch's sequences: 4 x 4096 rows over ~100 candidates): site i's context is
        ``seq`` without position i (or, with ``insert``, all of it, its tokens from i on one position
        later)."""
        group = max(1, 4 * self.chunk // max(1, len(vocab)))  # sites per call: <= 4 chunk rows
        out = []
        for start in range(0, len(sites), group):
            part = sites[start : start + group]
            ctx = [seq if insert else [*seq[:i], *seq[i + 1 :]] for i in part]
            positions = [
                [j if j < i else j + 1 for j in range(len(c))] for i, c in zip(part, ctx, strict=True)
            ]
            z = table.site(
                torch.tensor(ctx), torch.tensor(positions), torch.tensor(vocab), torch.tensor(part)
            )
            out.append(self.span.residual32(z))
        return torch.cat(out)

    def _site_full(self, seq: list[int], vocab: list[int], i: int, insert: bool) -> torch.Tensor:
        rest = seq[i:] if insert else seq[i + 1 :]
        seqs = torch.tensor([[*seq[:i], v, *rest] for v in vocab])
        z = self.block2_inputs(seqs)
        return self.span.residual32(z[:, i])

    def whole_inputs(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Block-2 inputs (len, d) of each whole sequence (grouped by length, one forward per group)."""
        return self._whole(seqs, lambda z: z)

    def whole_residuals(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Per-position L2 residuals of each whole sequence (grouped by length, one forward per group)."""
        return self._whole(seqs, self.span.residual)

    def _whole(self, seqs: list[list[int]], fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """``fn`` of the block-2 inputs (n, len, d) of each group of equal-length sequences, split per
        sequence in the input order."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        for idx in length_groups(seqs):
            t = torch.tensor([seqs[i] for i in idx])
            res = fn(self.block2_inputs(t))
            for j, i in enumerate(idx):
                out[i] = res[j]
        return out

    def polish(
        self,
        seq: list[int],
        vocab: list[int],
        *,
        max_len: int,
        config: PolishConfig,
        held: Sequence[list[int]] = (),
        walks: dict[tuple[int, ...], tuple[int, Polished]] | None = None,
    ) -> Polished:
        """Local search on a whole sequence under the exact L2 check (the encoder ``"polish"`` path).

        Objective: the mean log10 L2 residual over the positions (whole sequence, bidirectional context);
        the true sentence sits at ~-7 (MiniLM), and unlike the max or mean residual the per-position log
        terms credit every position that is right while others are still wrong. Each step evaluates exactly:
        the ``per_site`` best substitutions and insertions (screened by :meth:`site_residuals`) around the
        ``sites`` positions with the largest residual, every deletion, the ``moves`` worst tokens (with up
        to ``block`` - 1 tokens after them) moved to every other position and every swap of neighbours; it
        keeps the best if it lowers the objective. A step where none does tries, in turn, the two sweeps
        (``sweeps``: the screened sites re-chosen one after the other in each direction) and the wide
        trials (``wide``; see :meth:`_stall_step`), evaluated exactly. Sweeps in every step were a third
        of the polishes' time on a WikiText-2 batch (31.6 of 100 s of polish in a traced one-thread run)
        and the step's choice in 11 of 201 steps; at a stall only, that batch took 54.8 s and 59.5 s
        against 62.3 s and 65.6 s (2 cores, two runs each), every sentence still exact. The first and last
        tokens ([CLS], [SEP]) stay. Stops when every position passes the check, or (unless it already
        passes, and before the first step too) once it echoes a ``held`` sentence (:func:`echoes` at
        ``config.held_share``): it is descending into that sentence's basin and would only find it again.

        ``walks`` (the caller's, kept while the search's spans, screen and table, ``vocab``, ``max_len``,
        ``held`` and ``config`` but its ``steps`` stay the same) maps each sequence a walk that stopped on
        its own (not at ``steps``) passed through to the loop passes it then took (its steps, plus the pass
        that stopped it) and where it ended. A walk that reaches such a sequence with as many passes left
        ends the same way, so it returns that end at once: on a WikiText-2 batch two failing polishes walked
        the same 15 steps from their second on.
        """
        cur = list(seq)
        res = self.whole_residuals([cur])[0]
        best = _log_objective(res)
        path: list[tuple[int, ...]] = []  # the sequences this walk passes through
        end: Polished | None = None
        tail = 1  # loop passes the walk takes from path[-1] to its end (the last: the one that stops it)
        for n in range(config.steps):
            key = tuple(cur)
            seen = walks.get(key) if walks is not None else None
            if seen is not None and config.steps - n >= seen[0]:
                tail, end = seen[0] + 1, seen[1]
                break
            path.append(key)
            if float(res.max()) < self.threshold or len(cur) < 3:
                break
            if any(echoes(cur, h, config.held_share) for h in held):
                break
            trials = self._screened_trials(self._polish_trials(cur, res, vocab, max_len, config), config.keep)
            step = self._best_trial(trials, best)
            if step is None:  # stalled: the sweeps, then the wide trials (screened to ``keep``)
                step = self._stall_step(cur, res, vocab, max_len, config, best)
            if step is None:
                break
            cur, best, res = step
        else:
            return Polished(cur, float(res.max()), best)  # stopped at ``steps``: not remembered
        if end is None:
            end = Polished(cur, float(res.max()), best)
        if walks is not None:
            for i, key in enumerate(reversed(path)):
                walks[key] = (tail + i, end)
        return end

    def _screened_trials(self, trials: list[list[int]], keep: int) -> list[list[int]]:
        """The ``keep`` trials whose block-1 feed-forward inputs lie closest to the ``screen`` span (mean
        log10 residual over the positions), for the exact objective; all of them where there is no screen
        or no block-1 table for them, or ``keep`` is 0 or not below their number. The screen leaves out the
        feed-forward layer, most of the work per evaluated position; it ranked a step's exactly best trial
        first in 139 of 265 steps on a WikiText-2 batch (MiniLM), within 48 in 246 (measured while the
        sweeps were among every step's trials, before 0502c05). The others are not evaluated even where
        none of the kept improves (the stall step follows): evaluating them there made failing polishes
        walk on, 71.4 s against 60.9 s on that batch, no sentence more."""
        table = self._table
        if self.screen is None or table is None or not 0 < keep < len(trials):
            return trials
        if max(map(len, trials)) > table.length or not table.has(sorted({v for t in trials for v in t})):
            return trials
        score = torch.empty(len(trials))
        for idx in length_groups(trials):
            a = table.feed_forward_inputs(torch.tensor([trials[i] for i in idx]), self.chunk)
            score[idx] = torch.log10(self.screen.residual32(a).clamp_min(1e-9)).mean(dim=1)
        return [trials[i] for i in score.argsort()[:keep].tolist()]

    def _stall_step(
        self,
        cur: list[int],
        res: torch.Tensor,
        vocab: list[int],
        max_len: int,
        config: PolishConfig,
        best: float,
    ) -> tuple[list[int], float, torch.Tensor] | None:
        """A stalled step's way on: the two sweeps (``config.sweeps``), evaluated exactly, then, where
        neither improves, the ``config.keep`` wide trials (``config.wide``) closest to the feed-forward
        screen's span (:meth:`_screened_trials`), evaluated exactly; None where nothing improves.

        The screen takes each wide trial with its own context (block 1's attention over the whole edited
        sequence), unlike the per-site screen the wide trials make up for. On MiniLM (five batches a data
        set, 2 cores, one run each) evaluating only the 48 closest of the 200-800 wide trials took
        WikiText-2 from 31.1-32.1 s to 28.9 s a batch (its slowest, client 6: 54.8-59.5 s to 46.9 s) and
        Rotten Tomatoes from 21.0-21.4 s to 19.8 s, every sentence still exact (later runs: 29.0-29.9 s
        and 20.3-22.1 s, so the Rotten Tomatoes gain is within the spread); the 96 closest: 28.9 s
        (49.5 s) and 22.0 s. As with the regular trials (:meth:`_screened_trials`), evaluating more of them
        mostly lets failing polishes walk on."""
        step: tuple[list[int], float, torch.Tensor] | None = None
        if config.sweeps:
            sites = _sites(_worst(cur, res), config.sites, len(cur))
            sweeps = [self._sweep(cur, vocab, sites), self._sweep(cur, vocab, sites[::-1])]
            distinct = [list(t) for t in dict.fromkeys(map(tuple, sweeps)) if list(t) != cur]
            step = self._best_trial(distinct, best)
        if step is None and config.wide:
            wide = self._wide_trials(cur, res, vocab, max_len, config.wide)
            step = self._best_trial(self._screened_trials(wide, config.keep), best)
        return step

    def _best_trial(
        self, trials: list[list[int]], best: float
    ) -> tuple[list[int], float, torch.Tensor] | None:
        """The trial with the lowest objective (and its residuals) if it is below ``best``, else None."""
        if not trials:
            return None
        rs = self.whole_residuals(trials)
        scores = [_log_objective(r) for r in rs]
        i = min(range(len(trials)), key=scores.__getitem__)
        return (trials[i], scores[i], rs[i]) if scores[i] < best - 1e-9 else None

    @staticmethod
    def _wide_trials(
        cur: list[int], res: torch.Tensor, vocab: list[int], max_len: int, wide: int
    ) -> list[list[int]]:
        """Every substitution at the ``wide`` positions with the largest residual and every insertion
        next to them (distinct), for the stall step (:meth:`_stall_step`: screened, then evaluated exactly):
        when the sequence is off in a way that shifts every position's context (e.g. a missing word), the
        per-site screen of :meth:`site_residuals` can rank the right token low (24th of 92 in one WikiText-2
        case) while the exact objective ranks it first. Inserting a copy of a neighbour at either of its
        gaps gives one sequence, kept once."""
        worst = _worst(cur, res)[:wide]
        out = [[*cur[:i], v, *cur[i + 1 :]] for i in worst for v in vocab if v != cur[i]]
        if len(cur) < max_len:
            gaps = sorted({g for i in worst for g in (i, i + 1) if 1 <= g < len(cur)})
            out += [[*cur[:g], v, *cur[g:]] for g in gaps for v in vocab]
        return [list(t) for t in dict.fromkeys(map(tuple, out))]

    def _sweep(self, seq: list[int], vocab: list[int], sites: list[int]) -> list[int]:
        """Each of ``sites`` in turn set to its best token given the (updated) rest of the sequence: one
        trial that can change several neighbouring tokens at once (e.g. a whole wrong word)."""
        cur = list(seq)
        for i in sites:
            cur[i] = vocab[int(self.site_residuals(cur, vocab, [i], insert=False)[0].argmin())]
        return cur

    def _polish_trials(
        self, cur: list[int], res: torch.Tensor, vocab: list[int], max_len: int, config: PolishConfig
    ) -> list[list[int]]:
        """The candidate edits of one :meth:`polish` step (distinct, the current sequence excluded)."""
        inner = list(range(1, len(cur) - 1))
        worst = _worst(cur, res)
        sites = _sites(worst, config.sites, len(cur))
        near = set(sites)
        k = min(config.per_site, len(vocab))
        trials: list[list[int]] = [[*cur[:i], *cur[i + 1 :]] for i in inner]
        top = self.site_residuals(cur, vocab, sites, insert=False).topk(k, dim=1, largest=False).indices
        for i, row in zip(sites, top.tolist(), strict=True):
            trials += [[*cur[:i], vocab[j], *cur[i + 1 :]] for j in row if vocab[j] != cur[i]]
        if len(cur) < max_len:
            gaps = sorted(g for g in near | {q + 1 for q in near} if 1 <= g < len(cur))
            top = self.site_residuals(cur, vocab, gaps, insert=True).topk(k, dim=1, largest=False).indices
            for i, row in zip(gaps, top.tolist(), strict=True):
                trials += [[*cur[:i], vocab[j], *cur[i:]] for j in row]
        for q in worst[: config.moves]:
            for w in range(1, config.block + 1):  # the span cur[q : q + w] moved elsewhere
                if q + w > len(cur) - 1:
                    break
                part, rest = cur[q : q + w], [*cur[:q], *cur[q + w :]]
                trials += [[*rest[:j], *part, *rest[j:]] for j in range(1, len(rest)) if j != q]
        trials += [[*cur[:i], cur[i + 1], cur[i], *cur[i + 2 :]] for i in inner[:-1]]  # adjacent swaps
        seen = {tuple(cur)}
        out = []
        for t in trials:
            if tuple(t) not in seen:
                seen.add(tuple(t))
                out.append(t)
        return out

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


def length_groups(seqs: Sequence[list[int]]) -> list[list[int]]:
    """The indices of ``seqs`` grouped by sequence length (each group one batched forward)."""
    groups: dict[int, list[int]] = {}
    for i, q in enumerate(seqs):
        groups.setdefault(len(q), []).append(i)
    return list(groups.values())


def held_ngrams(held: Sequence[list[int]], n: int) -> set[tuple[int, ...]]:
    """Every n-gram (n >= 2) of the held sentences; empty when n < 2 or nothing is held."""
    if n < 2:
        return set()
    return {tuple(s[i : i + n]) for s in held for i in range(len(s) - n + 1)}


def similar(a: list[int], b: list[int], fraction: float = 0.7) -> bool:
    """True when ``a`` and ``b`` share at least ``fraction`` of the tokens (with multiplicity) of the longer
    one: variants of one sentence (shifted, with a word moved or dropped) count as the same sentence, while
    a long sequence is not a variant of a short one whose few tokens it happens to contain."""
    common = sum((Counter(a) & Counter(b)).values())
    return common >= fraction * max(len(a), len(b))


def echoes(seq: list[int], held: list[int], share: float) -> bool:
    """True when the bigrams (adjacent token pairs, with multiplicity) that ``seq`` and ``held`` share are
    at least ``share`` of the longer one's count: ``seq`` is a variant of ``held`` with pieces moved or
    replaced (symmetric, as :func:`similar`). Bigrams, not tokens as :func:`similar` counts, because
    distinct sentences share common tokens ("the", ",", "<", "unk", ">") far more than runs of them: the
    sentences of the WikiText-2 batch of ``text_encoder_speed.toml`` share up to 62 % of their tokens but
    35 % of their bigrams."""
    pairs = Counter(itertools.pairwise(seq))
    common = sum((pairs & Counter(itertools.pairwise(held))).values())
    return common >= share * max(len(seq) - 1, len(held) - 1, 1)


@dataclass(frozen=True)
class PolishConfig:
    """Budget of one :meth:`L2Search.polish` run (see there)."""

    steps: int = 60  # exact-evaluation steps (each keeps one edit)
    sites: int = 10  # positions with the largest residual (and their neighbours) screened per step
    per_site: int = 3  # substitutions / insertions per screened site evaluated exactly
    moves: int = 3  # tokens with the largest residual tried at every other position
    block: int = 2  # moved spans: up to this many tokens from each of those positions
    sweeps: bool = True  # at a stall: re-choose the screened sites one after the other (both directions)
    wide: int = 3  # at a stall, after the sweeps: every token at this many worst positions, screened (0: off)
    # stop once the sequence shares this much of its bigrams with one held sentence (``echoes``)
    held_share: float = 0.5
    # trials a step evaluates exactly: those closest to the feed-forward screen's span, of the regular trials
    # and at a stall of the wide ones (0: all of them; all of them too where the search has no screen:
    # ``screen_keep`` 0, no block-1 table, or no rank match)
    keep: int = 48

    def __post_init__(self) -> None:
        if not 0 < self.held_share <= 1:
            raise ValueError(f"held_share must be in (0, 1], got {self.held_share}")
        for name in ("steps", "sites", "per_site", "block"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("moves", "wide", "keep"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Polished:
    """A polished sequence, its largest L2 residual and its objective (mean log10 residual)."""

    seq: list[int]
    worst: float
    objective: float


def _worst(cur: list[int], res: torch.Tensor) -> list[int]:
    """The inner positions of ``cur`` (its first and last tokens stay), largest residual ``res`` first."""
    return sorted(range(1, len(cur) - 1), key=lambda i: -float(res[i]))


def _sites(worst: list[int], n: int, length: int) -> list[int]:
    """The inner positions of a sequence of ``length`` among the first ``n`` of ``worst`` (:func:`_worst`)
    and their neighbours, in order."""
    near = {q for i in worst[:n] for q in (i - 1, i, i + 1)}
    return [i for i in range(1, length - 1) if i in near]


def _log_objective(res: torch.Tensor) -> float:
    """Mean log10 of the per-position residuals (floored at 1e-9, below float32 rounding)."""
    return float(torch.log10(res.clamp_min(1e-9)).mean())


@torch.no_grad()
def _bert_site(layer: Any, ctx: torch.Tensor, zc: torch.Tensor) -> torch.Tensor:
    """(n, c, d): BERT block-1 output of each candidate (layer-1 inputs ``zc`` (c, d)) attending over its
    own key and the context's (layer-1 inputs ``ctx`` (n, m, d), positions already applied).

    Under post-LN BERT layers the context's keys and values depend on their own layer-1 inputs only, so a
    single query per candidate gives that position's block-2 input exactly.
    """
    n, m, _ = ctx.shape
    c = zc.shape[0]
    sa = layer.attention.self
    h, dh = int(sa.num_attention_heads), int(sa.attention_head_size)
    kp, vp = sa.key(ctx).view(n, m, h, dh), sa.value(ctx).view(n, m, h, dh)
    qc, kc, vc = (f(zc).view(c, h, dh) for f in (sa.query, sa.key, sa.value))
    return finish(layer, *attend_heads(kp, vp, qc, kc, vc, zc))

"""The block-1 table of DAGER's encoder search (``attacks/text/dager/block1.py``) against the model's forward.

The table is a faster route to the same block-2 inputs: every value it gives is compared with the slow,
obvious reference (the model's own forward through block 1, captured at block 2's input) on the tiny BERT
with the real vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.text.dager import block1
from gradleak.attacks.text.dager.block1 import Block1Table
from gradleak.attacks.text.dager.core import Dager, DagerConfig, EncoderSearch
from gradleak.attacks.text.dager.search import L2Search, _bert_site
from gradleak.attacks.text.family import (
    estimate_span,
    family_of,
    find_module,
    input_side_gradient,
    layer_inputs,
)
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation


def _search(tm, batch):
    obs = Observation(
        tm.model, fedsgd_text_update(tm.model, batch, "classification"), (batch.input_ids.shape[1],), 2
    )
    return _search_of(tm, obs)


def _search_of(tm, obs):
    model, spec = tm.model, family_of(tm.model)
    span2 = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
    m1 = find_module(model, spec.attn_inputs[0].format(i=0))[1]
    m2 = find_module(model, spec.attn_inputs[0].format(i=1))[1]
    return obs, L2Search(model, m2, span2, spec.l2_threshold, first=m1)


def _tokens(batch):
    return sorted({t for s in batch.sequences() for t in s})


def _tabled(tm, make_batch, length: int):
    """The batch, its L2 search with a block-1 table of the batch's tokens x ``length`` positions, the
    tokens and the table."""
    batch = make_batch(tm)
    _, search = _search(tm, batch)
    tokens = _tokens(batch)
    search.tabulate(tokens, length)
    table = search._table
    assert table is not None and table.length == length
    return batch, search, tokens, table


def test_table_whole_sequences_equal_the_models_forward(bert_cls, make_batch):
    _, search, tokens, table = _tabled(bert_cls, make_batch, 9)
    g = torch.Generator().manual_seed(0)
    for length in (1, 4, 9):
        seqs = torch.tensor(tokens)[torch.randint(len(tokens), (5, length), generator=g)]
        ref = layer_inputs(bert_cls.model, search.module, seqs)
        got = table.whole(seqs)
        assert got.shape == ref.shape
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_table_site_equals_one_query_path_from_the_model(bert_cls, make_batch):
    # the candidate at position t attending over a context at positions 0..t-1 (and, for site
    # residuals, a context with a gap at the site): the table against _bert_site on the model's own
    # layer-1 inputs
    batch = make_batch(bert_cls)
    _, search = _search(bert_cls, batch)
    tokens = _tokens(batch)
    search.tabulate(tokens, 8)
    table, layer = search._table, search.block1()
    assert table is not None and layer is not None
    seq = batch.sequences()[0][:6]
    cands = tokens[:5]
    positions = torch.tensor([0, 1, 2, 4, 5, 6])  # a gap at 3
    ctx1 = layer_inputs(bert_cls.model, search.first, torch.tensor([seq]))[0]
    # each token's layer-1 input at its own position (context-free), then placed at the gap's positions
    zs = torch.stack(
        [
            layer_inputs(bert_cls.model, search.first, torch.tensor([[t]]), start_position=int(p))[0, 0]
            for t, p in zip(seq, positions, strict=True)
        ]
    )
    zc = layer_inputs(bert_cls.model, search.first, torch.tensor(cands).unsqueeze(1), start_position=3)[:, 0]
    ref = _bert_site(layer, zs.unsqueeze(0), zc)
    got = table.site(torch.tensor([seq]), positions, torch.tensor(cands), 3)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    # and against the model's whole forward of each edited sequence: seq[:3], the candidate, seq[3:6]
    edited = torch.tensor([[*seq[:3], c, *seq[3:6]] for c in cands])
    whole = layer_inputs(bert_cls.model, search.module, edited)[:, 3]
    assert float((got[0] - whole).abs().max()) <= 1e-5 * float(whole.abs().max())
    assert torch.allclose(table.inputs(torch.tensor([seq]))[0], ctx1, rtol=1e-5, atol=1e-6)


def test_search_residuals_are_the_same_with_and_without_the_table(bert_cls, make_batch, monkeypatch):
    # (residuals are compared to 1e-6 absolute: in-span ones are float32 rounding, ~1e-7, on either path)
    batch = make_batch(bert_cls)
    _, search = _search(bert_cls, batch)
    seq = batch.sequences()[1]
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})
    sites = list(range(1, len(seq) - 1))
    plain = {ins: search.site_residuals(seq, vocab, sites, insert=ins) for ins in (False, True)}
    whole_plain = search.whole_residuals([seq, seq[:-2] + seq[-1:]])
    prefixes = [s[:3] for s in batch.sequences()]
    last_plain = search.encoder_last_residuals(prefixes, vocab, 3)
    assert search._fast is True  # the plain runs took the one-query path, not whole edited sequences
    search.tabulate(_tokens(batch), len(seq) + 1)
    assert search._table is not None
    calls = {"site": 0, "whole": 0}
    for name in calls:
        real = getattr(Block1Table, name)

        def spy(self, *args, _name=name, _real=real, **kw):
            calls[_name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(Block1Table, name, spy)
    for ins in (False, True):
        assert torch.allclose(
            search.site_residuals(seq, vocab, sites, insert=ins), plain[ins], rtol=1e-3, atol=1e-6
        )
    for a, b in zip(search.whole_residuals([seq, seq[:-2] + seq[-1:]]), whole_plain, strict=True):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6)
    assert torch.allclose(search.encoder_last_residuals(prefixes, vocab, 3), last_plain, rtol=1e-3, atol=1e-6)
    # one site call per screen (every site at once: substitutions, insertions) and one for the beam step;
    # one whole call per sequence length
    assert calls["site"] == 3 and calls["whole"] == 2


def test_sequences_the_table_does_not_cover_use_the_models_forward(bert_cls, make_batch):
    batch = make_batch(bert_cls)
    _, search = _search(bert_cls, batch)
    seq = batch.sequences()[0]
    search.tabulate(seq[:3], 4)  # neither all tokens nor the length
    table = search._table
    assert table is not None
    assert table.covers([seq[:3]]) and not table.covers([seq]) and not table.covers([seq[:3] * 2])
    ref = layer_inputs(bert_cls.model, search.module, torch.tensor([seq]))
    assert torch.equal(search.block2_inputs(torch.tensor([seq])), ref)


def test_no_table_beyond_its_memory_cap_or_where_it_disagrees(bert_cls, make_batch, monkeypatch):
    batch = make_batch(bert_cls)
    _, search = _search(bert_cls, batch)
    monkeypatch.setattr(block1, "MAX_TABLE_BYTES", 1024)
    search.tabulate(_tokens(batch), 8)
    assert search._table is None
    monkeypatch.undo()
    layer = search.block1()
    # a block 1 other than the model's: its outputs disagree with the forward, so no table
    wrong = type(layer)(bert_cls.model.config)
    assert Block1Table.build(bert_cls.model, search.first, search.module, wrong, _tokens(batch), 8) is None
    assert (
        Block1Table.build(bert_cls.model, search.first, search.module, layer, _tokens(batch), 8) is not None
    )


def test_attack_recovers_the_same_batch_with_and_without_the_table(bert_cls, make_batch):
    batch = make_batch(bert_cls)
    obs, _ = _search(bert_cls, batch)
    end = int(bert_cls.tokenizer.sep_token_id)
    out, built = {}, []
    real = L2Search.tabulate

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        built.append(self._table is not None)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(L2Search, "tabulate", spy)
        for table in (True, False):
            attack = Dager(DagerConfig(encoder=EncoderSearch(end_token_id=end, table=table)))
            out[table] = attack.reconstruct(obs, generator=torch.Generator().manual_seed(0)).token_ids
    assert built == [True]  # the first search used a table, the second none
    assert sorted(out[True]) == sorted(out[False]) == sorted(batch.sequences())


def test_span_residual_equals_the_projection_reference_at_every_rank():
    # Span.residual (norm of the coordinates in the orthogonal complement) against the obvious
    # ||z - B B^T z|| / ||z||, for vectors in the span (float32 rounding), off it, and at rank 0 and d
    from gradleak.attacks.text.family import Span

    g = torch.Generator().manual_seed(0)
    d = 48
    for r in (0, 1, 20, d):
        basis, _ = torch.linalg.qr(torch.randn(d, max(r, 1), dtype=torch.float64, generator=g))
        basis = basis[:, :r]
        span = Span(basis, torch.ones(r))
        inside = (torch.randn(30, r, dtype=torch.float64, generator=g) @ basis.T).float()
        outside = torch.randn(30, d, generator=g)
        for z in (inside, outside):
            z64 = z.double()
            ref = (z64 - (z64 @ basis) @ basis.T).norm(dim=-1) / z64.norm(dim=-1).clamp_min(1e-30)
            assert torch.allclose(span.residual(z), ref, rtol=1e-6, atol=1e-12)
    assert span.complement.shape == (d, 0)


def test_float32_screen_residual_is_the_float64_one_to_1e_6():
    # Span.residual32 (the site screens' ranking) against Span.residual, on both of its routes (the
    # complement where d - r < 2 r, else the basis); a projected span has no float32 shortcut
    from gradleak.attacks.text.family import ProjectedSpan, Span

    g = torch.Generator().manual_seed(0)
    d = 64
    for r in (5, 40):
        basis, _ = torch.linalg.qr(torch.randn(d, r, dtype=torch.float64, generator=g))
        span = Span(basis, torch.ones(r))
        inside = (torch.randn(20, r, dtype=torch.float64, generator=g) @ basis.T).float()
        z = torch.cat([inside, torch.randn(20, d, generator=g)])
        assert torch.allclose(span.residual32(z).double(), span.residual(z), rtol=0, atol=1e-6)
    small, _ = torch.linalg.qr(torch.randn(8, 3, dtype=torch.float64, generator=g))
    proj = ProjectedSpan.of(Span(small, torch.ones(3)), torch.randn(8, d, dtype=torch.float64, generator=g))
    assert torch.equal(proj.residual32(z), proj.residual(z))
    from gradleak.attacks.text.dager.spectral import NoisySpan

    noisy = NoisySpan(basis, torch.linspace(2, 1, 40, dtype=torch.float64), noise_std=0.1, cap=10.0)
    assert torch.equal(noisy.residual32(z), noisy.residual(z))  # a noise-aware bound: its own residual


def test_table_site_with_a_context_per_site_equals_the_edited_sequences(bert_cls, make_batch):
    # several sites in one call (each context its own positions and site) against the model's forward
    # of each edited sequence, substitution and insertion
    batch, search, tokens, table = _tabled(bert_cls, make_batch, 10)
    seq, cands, sites = batch.sequences()[1], tokens[:4], [1, 3, 5]
    for insert in (False, True):
        ctx = [seq if insert else [*seq[:i], *seq[i + 1 :]] for i in sites]
        pos = [[j if j < i else j + 1 for j in range(len(c))] for i, c in zip(sites, ctx, strict=True)]
        got = table.site(torch.tensor(ctx), torch.tensor(pos), torch.tensor(cands), torch.tensor(sites))
        assert got.shape[:2] == (len(sites), len(cands))
        for row, i in zip(got, sites, strict=True):
            edited = torch.tensor([[*seq[:i], c, *(seq[i:] if insert else seq[i + 1 :])] for c in cands])
            ref = layer_inputs(bert_cls.model, search.module, edited)[:, i]
            assert float((row - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_site_screens_split_by_chunk_give_the_one_call_result(bert_cls, make_batch):
    # chunk = 1: one table call per site (the bound on rows per call), against every site in one call
    batch, search, _, _ = _tabled(bert_cls, make_batch, 10)
    seq = batch.sequences()[1]
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})
    sites = list(range(1, len(seq) - 1))
    whole = {ins: search.site_residuals(seq, vocab, sites, insert=ins) for ins in (False, True)}
    search.chunk = 1
    for ins in (False, True):
        split = search.site_residuals(seq, vocab, sites, insert=ins)
        assert torch.allclose(split, whole[ins], rtol=1e-4, atol=1e-6)


def _screened(tm, make_batch):
    """The batch, its tabled L2 search, the batch tokens and the feed-forward span read off the update."""
    batch = make_batch(tm)
    obs, search = _search(tm, batch)
    tokens = _tokens(batch)
    search.tabulate(tokens, batch.input_ids.shape[1])
    span = Dager().feed_forward_span(obs, tm.model, search, family_of(tm.model), search.span)
    # an exact update: the feed-forward inputs span as many dimensions as block 2's (the batch's positions)
    assert span is not None and span.rank == search.span.rank < span.basis.shape[0]
    return batch, search, tokens, span


def test_the_attack_screens_and_recovers_the_same_batch(bert_cls, make_batch):
    batch = make_batch(bert_cls)
    obs, _ = _search(bert_cls, batch)
    end = int(bert_cls.tokenizer.sep_token_id)
    calls = []
    real = L2Search._screened_last

    def spy(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    recs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(L2Search, "_screened_last", spy)
        # ~2 candidates a position here, so keeping 1 a prefix screens at the default beam
        configs = {
            keep: DagerConfig(encoder=EncoderSearch(end_token_id=end, screen_keep=keep, per_prefix=1))
            for keep in (0, 1)
        }
        for keep, config in configs.items():
            recs[keep] = Dager(config).reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert any(calls)  # the screened run took the screen
    assert sorted(recs[1].token_ids) == sorted(recs[0].token_ids) == sorted(batch.sequences())
    assert recs[1].stats["screen_rank"] == recs[1].stats["rank_l2"] > 0
    assert recs[0].stats["screen_rank"] == 0


def test_no_screen_on_a_noised_update_or_for_the_noise_aware_attacks(bert_cls, make_batch):
    from gradleak.attacks.text.dager.masked import DagerMasked
    from gradleak.attacks.text.dager.spectral import DagerSpectral

    batch = make_batch(bert_cls)
    obs, search = _search(bert_cls, batch)
    spec = family_of(bert_cls.model)
    for attack in (DagerSpectral(), DagerMasked()):
        assert attack.feed_forward_span(obs, bert_cls.model, search, spec, search.span) is None
    # exact DAGER on a noised update: the spans' ranks disagree (or fill the space), so no screen
    g = torch.Generator().manual_seed(0)
    noised = {
        n: t + 1e-3 * t.abs().max() * torch.randn(t.shape, generator=g) for n, t in obs.update.tensors.items()
    }
    noisy = Observation(obs.model, obs.update.replace(noised), obs.input_shape, 2)
    _, noisy_search = _search_of(bert_cls, noisy)
    assert Dager().feed_forward_span(noisy, bert_cls.model, noisy_search, spec, noisy_search.span) is None


def test_feed_forward_input_of_a_site_equals_the_models(bert_cls, make_batch):
    # the screen's feed-forward inputs (table attention + output projection) against the model's own
    # input of block 1's intermediate.dense, captured on the whole sequences s + [v]
    batch, search, tokens, _ = _screened(bert_cls, make_batch)
    layer = search.block1()
    seq = batch.sequences()[0]
    prefixes, t = [seq[:4], seq[1:5]], 4
    heads, z1 = search._table.site_heads(torch.tensor(prefixes), torch.arange(t), torch.tensor(tokens), t)
    with torch.no_grad():
        got = block1.attention_output(layer, heads, z1)  # (n, c, d)
    seqs = torch.tensor([p + [v] for p in prefixes for v in tokens])
    ref = layer_inputs(bert_cls.model, layer.intermediate.dense, seqs)[:, -1].view(got.shape)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_feed_forward_screen_keeps_exact_scores_and_the_true_last_token(bert_cls, make_batch):
    batch, search, tokens, span = _screened(bert_cls, make_batch)
    for s in batch.sequences():
        prefixes, t = [s[:-1], s[:-2]], len(s) - 1  # the true sentence but its last token, and a shorter one
        prefixes[1] = [*prefixes[1], prefixes[1][-1]]
        search.screen, search.screen_keep = None, 0
        ref = search.encoder_last_residuals(prefixes, tokens, t)  # no screen: every extension scored
        search.screen, search.screen_keep = span, 1
        got = search.encoder_last_residuals(prefixes, tokens, t)
        kept = torch.isfinite(got)
        assert kept.sum(dim=1).tolist() == [1, 1]
        # kept scores are the unscreened ones: the relative residual of the same block-2 input, computed in
        # float32 in another batch shape, so equal to float32 rounding (1e-7 of the input's norm)
        torch.testing.assert_close(got[kept], ref[kept], rtol=0, atol=1e-7)
        # with its whole sentence as context the true last token's feed-forward input lies in the span
        # (one of the update's own inputs), so even a screen keeping one extension keeps it
        assert tokens[int(got[0].argmin())] == s[-1]
        # screen_keep >= the candidates: no screen, the same matrix
        search.screen_keep = len(tokens)
        torch.testing.assert_close(search.encoder_last_residuals(prefixes, tokens, t), ref, rtol=0, atol=0)


def test_whole_sequence_feed_forward_inputs_equal_the_models(bert_cls, make_batch):
    # the polish's trial screen: block 1's feed-forward inputs of whole sequences from the table against
    # the model's own input of intermediate.dense, at every position, for several lengths
    batch, search, tokens, _ = _screened(bert_cls, make_batch)
    layer = search.block1()
    g = torch.Generator().manual_seed(0)
    for length in (2, 5, batch.input_ids.shape[1]):
        seqs = torch.tensor(tokens)[torch.randint(len(tokens), (6, length), generator=g)]
        got = search._table.feed_forward_inputs(seqs)
        ref = layer_inputs(bert_cls.model, layer.intermediate.dense, seqs)
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


def test_polish_trial_screen_keeps_the_trials_closest_to_the_span(bert_cls, make_batch):
    """``_screened_trials`` against a slow reference: each trial's mean log10 residual of the model's own
    feed-forward inputs (captured per trial) to the span; the kept trials are the ``keep`` best of those,
    and the true sentence, whose inputs lie in the span (mean log10 residual -5.3 against -2.4 and above
    for the others, measured), is among them."""
    batch, search, tokens, span = _screened(bert_cls, make_batch)
    search.screen = span
    layer = search.block1()
    true = batch.sequences()[0]
    g = torch.Generator().manual_seed(1)
    trials = [true]
    for _ in range(11):  # one substitution each, of varied lengths (a deletion every third)
        i = int(torch.randint(1, len(true) - 1, (1,), generator=g))
        v = tokens[int(torch.randint(len(tokens), (1,), generator=g))]
        trials.append([*true[:i], *true[i + 1 :]] if len(trials) % 3 == 0 else [*true[:i], v, *true[i + 1 :]])

    def ref_score(t):
        z = layer_inputs(bert_cls.model, layer.intermediate.dense, torch.tensor([t]))[0]
        return float(torch.log10(span.residual(z).clamp_min(1e-9)).mean())

    ref = [ref_score(t) for t in trials]
    kept = search._screened_trials(trials, 4)
    assert len(kept) == 4 and true in kept
    order = sorted(range(len(trials)), key=ref.__getitem__)
    assert ref[order[4]] - ref[order[3]] > 1e-2  # a margin far above the float32 screen's rounding
    assert {tuple(trials[i]) for i in order[:4]} == {tuple(t) for t in kept}
    assert search._screened_trials(trials, 0) == trials  # off
    search.screen = None
    assert search._screened_trials(trials, 4) == trials  # no screen: all of them

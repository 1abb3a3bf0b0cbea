"""DAGER recovers short batches exactly on tiny GPT-2 and BERT configs (random init, real tokenizers)."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.text.baseline import null_observation
from gradleak.attacks.text.dager.core import Dager, DagerConfig, DecoderSearch, EncoderSearch
from gradleak.attacks.text.dager.search import L2Search, PolishConfig
from gradleak.registry import ATTACKS
from gradleak.tasks.text_client import fedavg_text_update, fedsgd_text_update
from gradleak.types import AttackInputError, Observation


def _observe(tm, batch, task):
    update = fedsgd_text_update(tm.model, batch, task)
    return Observation(tm.model, update, (batch.input_ids.shape[1],), 2)


def _gen():
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("fixture,task", [("gpt2_cls", "classification"), ("bert_cls", "classification")])
def test_dager_exact_batch_of_two(request, make_batch, fixture, task):
    tm = request.getfixturevalue(fixture)
    batch = make_batch(tm)
    rec = ATTACKS.create("dager").reconstruct(_observe(tm, batch, task), generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    texts = {tm.tokenizer.decode(s, skip_special_tokens=True).replace(" .", ".") for s in rec.token_ids}
    assert texts == {"the movie was surprisingly good", "a dull and lifeless film."}


def test_dager_causal_lm_exact_with_last_token_from_lm_head(gpt2_lm, make_batch):
    batch = make_batch(gpt2_lm)
    obs = _observe(gpt2_lm, batch, "causal_lm")
    rec = Dager().reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    # without the LM-head completion the last token of each sequence is out of reach of the span checks
    short = Dager(DagerConfig(decoder=DecoderSearch(complete_last_token=False))).reconstruct(
        obs, generator=_gen()
    )
    assert sorted(short.token_ids) == sorted(s[:-1] for s in batch.sequences())


def test_dager_greedy_search_and_span_ranks(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    rec = Dager(DagerConfig(decoder=DecoderSearch(search="greedy"))).reconstruct(
        _observe(gpt2_cls, batch, "classification"), generator=_gen()
    )
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    assert rec.stats["rank_l1"] == len({(t, p) for s in batch.sequences() for p, t in enumerate(s)})


def test_dager_fedavg_variant_attacks_multistep_delta(gpt2_cls, make_batch):
    batch = make_batch(gpt2_cls)
    update = fedavg_text_update(gpt2_cls.model, [batch], "classification", lr=1e-3, epochs=3)
    obs = Observation(gpt2_cls.model, update, (batch.input_ids.shape[1],), 2)
    rec = ATTACKS.create("dager_fedavg").reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())


def test_dager_on_null_gradient_recovers_nothing(gpt2_cls, make_batch):
    obs = _observe(gpt2_cls, make_batch(gpt2_cls), "classification")
    rec = Dager().reconstruct(null_observation(obs, _gen()), generator=_gen())
    assert rec.token_ids == []


def test_dager_rejects_frozen_attention(gpt2_cls, make_batch):
    obs = _observe(gpt2_cls, make_batch(gpt2_cls), "classification")
    zeroed = {n: (torch.zeros_like(t) if ".attn." in n else t) for n, t in obs.update.tensors.items()}
    frozen = Observation(obs.model, obs.update.replace(zeroed), obs.input_shape, 2)
    with pytest.raises(AttackInputError, match="zero"):
        Dager().reconstruct(frozen, generator=_gen())


def test_dager_config_validation():
    with pytest.raises(ValueError, match="search"):
        DecoderSearch(search="dfs")
    with pytest.raises(ValueError, match="l1_threshold"):
        DagerConfig(l1_threshold=2.0)
    with pytest.raises(ValueError, match="held_ngram"):
        EncoderSearch(held_ngram=1)
    with pytest.raises(ValueError, match="screen_keep"):
        EncoderSearch(screen_keep=-1)
    with pytest.raises(ValueError, match="below per_prefix"):
        EncoderSearch(screen_keep=2, per_prefix=4)
    with pytest.raises(ValueError, match="wide"):
        PolishConfig(wide=-1)
    for share in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="held_share"):
            PolishConfig(held_share=share)
    with pytest.raises(ValueError, match="unknown option"):
        ATTACKS.create("dager", nonsense=1)


def test_dager_with_embedding_channel_vocabulary(gpt2_lm, make_batch):
    batch = make_batch(gpt2_lm)
    obs = _observe(gpt2_lm, batch, "causal_lm")
    rec = Dager(DagerConfig(vocab="embedding")).reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())


def test_span_rank_is_after_the_last_sharp_drop():
    from gradleak.attacks.text.family import estimate_span

    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))[0]
    s = torch.tensor([1.0, 1e-2, 5e-3, 3e-3, 2e-3] + [1e-9] * 59, dtype=torch.float64)  # dominant first value
    span = estimate_span(u @ torch.diag(s) @ u.T, rank_tol=1e-8)
    assert span.rank == 5 and not span.full
    noise = estimate_span(torch.randn(64, 200, generator=g), rank_tol=1e-8)
    assert noise.full


def test_dager_rotary_rejects_repeated_token_runs(tiny_llama):
    # Under rotary attention [a, a, ...] has the block-2 input of [a] at every position, so each first
    # token also grows a run that the span accepts; the repeat rule removes those runs.
    seqs = [[11, 57, 203, 9, 141, 77], [34, 120, 5, 260, 88, 19]]
    obs = tiny_llama(seqs)
    rec = Dager().reconstruct(obs, generator=_gen())
    assert sorted(s[:-1] for s in rec.token_ids) == sorted(s[:-1] for s in seqs), rec.token_ids
    assert rec.stats["accepted"] == 2
    loose = Dager(DagerConfig(repeat_tol=0.0)).reconstruct(obs, generator=_gen())
    assert loose.stats["accepted"] > 2  # the runs [11, 11, ...] and [34, 34, ...] pass the L2 check


@pytest.mark.parametrize("encoder", ["polish", "beam", "sample"])
def test_dager_encoder_paths_recover_bert_batch(bert_cls, make_batch, encoder):
    batch = make_batch(bert_cls)
    end = int(bert_cls.tokenizer.sep_token_id)
    attack = Dager(DagerConfig(encoder=EncoderSearch(method=encoder, end_token_id=end)))
    rec = attack.reconstruct(_observe(bert_cls, batch, "classification"), generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    assert rec.stats["filled"] == 0


def test_encoder_repair_fixes_a_wrong_and_a_missing_token(bert_cls, make_batch):
    from gradleak.attacks.text.dager.search import L2Search
    from gradleak.attacks.text.family import estimate_span, family_of, find_module, input_side_gradient

    batch = make_batch(bert_cls)
    obs = _observe(bert_cls, batch, "classification")
    model, spec = bert_cls.model, family_of(bert_cls.model)
    span2 = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
    m2 = find_module(model, spec.attn_inputs[0].format(i=1))[1]
    search = L2Search(model, m2, span2, spec.l2_threshold)
    true = batch.sequences()[1]
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})
    other = next(v for v in vocab if v != true[3])
    broken = [*true[:3], other, *true[4:-2], *true[-1:]]  # position 3 substituted, the "." dropped
    fixed, worst, _ = search.repair(broken, vocab, steps=4, max_len=len(true) + 2)
    assert fixed == true and worst < spec.l2_threshold
    stuck, worst, _ = search.repair(broken, vocab, steps=1, max_len=len(true) + 2)
    assert stuck != true and worst > spec.l2_threshold  # one edit is not enough: the check is exact


def test_encoder_fast_path_matches_full_forward(bert_cls, make_batch):
    from gradleak.attacks.text.dager.search import L2Search
    from gradleak.attacks.text.family import estimate_span, family_of, find_module, input_side_gradient

    batch = make_batch(bert_cls)
    obs = _observe(bert_cls, batch, "classification")
    model, spec = bert_cls.model, family_of(bert_cls.model)
    span2 = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
    m1 = find_module(model, spec.attn_inputs[0].format(i=0))[1]
    m2 = find_module(model, spec.attn_inputs[0].format(i=1))[1]
    search = L2Search(model, m2, span2, spec.l2_threshold, first=m1)
    prefixes, cands = [s[:4] for s in batch.sequences()], [1996, 3185, 2001, 102]
    fast = search._bert_last(search.block1(), prefixes, cands, 4)
    full = search._full_last(prefixes, cands)
    assert torch.allclose(fast, full, atol=1e-5, rtol=1e-4)


def test_last_token_refinement_fixes_tied_head_cosine_errors(gpt2_lm):
    # last tokens drawn from a small pool also occur as inputs: under a tied head their rows carry the
    # input-embedding gradient too and the cosine read-off picks wrong tokens; the joint check does not
    from gradleak.attacks.text.lm_completion import complete_last_tokens
    from gradleak.data.text import TextBatch

    g = torch.Generator().manual_seed(1)
    wrong_cos = wrong_joint = 0
    for _ in range(10):
        pool = torch.randint(100, 2000, (12,), generator=g)
        ids = pool[torch.randint(12, (4, 6), generator=g)]
        obs = _observe(gpt2_lm, TextBatch(ids, torch.ones_like(ids)), "causal_lm")
        seqs = ids.tolist()
        prefixes = [s[:-1] for s in seqs]
        cos = complete_last_tokens(obs, gpt2_lm.model, prefixes, refine=0)
        joint = complete_last_tokens(obs, gpt2_lm.model, prefixes)
        wrong_cos += sum(a != b for a, b in zip(cos, seqs, strict=True))
        wrong_joint += sum(a != b for a, b in zip(joint, seqs, strict=True))
    assert wrong_joint == 0  # (how often the plain cosine read-off errs depends on rounding: not asserted)


def _l2_search(tm, obs):
    from gradleak.attacks.text.dager.search import L2Search
    from gradleak.attacks.text.family import estimate_span, family_of, find_module, input_side_gradient

    model, spec = tm.model, family_of(tm.model)
    span2 = estimate_span(input_side_gradient(obs, model, spec.attn_inputs, 1), spec.rank_tol)
    m1 = find_module(model, spec.attn_inputs[0].format(i=0))[1]
    m2 = find_module(model, spec.attn_inputs[0].format(i=1))[1]
    return L2Search(model, m2, span2, spec.l2_threshold, first=m1)


@pytest.mark.parametrize("insert", [False, True])
def test_encoder_site_residuals_match_brute_force(bert_cls, make_batch, insert):
    # the one-query fast path against whole edited sequences recomputed (a tiny vocabulary)
    batch = make_batch(bert_cls)
    search = _l2_search(bert_cls, _observe(bert_cls, batch, "classification"))
    seq = batch.sequences()[1]
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})[:6]
    sites = [1, 3, len(seq) - 2]
    fast = search.site_residuals(seq, vocab, sites, insert=insert)
    assert search._fast is True
    for row, i in zip(fast, sites, strict=True):
        edited = [[*seq[:i], v, *(seq[i:] if insert else seq[i + 1 :])] for v in vocab]
        brute = torch.stack([r[i] for r in search.whole_residuals(edited)])
        assert torch.allclose(row.double(), brute, rtol=1e-3, atol=1e-6)  # a float32 screen
    # in the true context the true token is the best at every position
    inner = list(range(1, len(seq) - 1))
    full = sorted({t for s in batch.sequences() for t in s[1:-1]})
    best = search.site_residuals(seq, full, inner, insert=False).argmin(dim=1)
    assert [full[j] for j in best.tolist()] == seq[1:-1]


def test_encoder_polish_restores_three_dropped_words(bert_cls, make_batch):

    batch = make_batch(bert_cls)
    search = _l2_search(bert_cls, _observe(bert_cls, batch, "classification"))
    true = batch.sequences()[0]  # [CLS] the movie was surprisingly good [SEP]
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})
    broken = [true[0], *true[4:]]  # "the movie was" dropped
    polished = search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig())
    assert polished.seq == true and polished.worst < search.threshold and polished.objective < -4


def test_polish_sweeps_only_where_a_step_stalls(bert_cls, make_batch, monkeypatch):
    """The sweeps are a stalled step's first way on (before the wide trials): with no regular trials the
    sweeps alone put a wrong token right, without them nothing moves; with the regular trials a sweep
    only follows a step whose trials did not improve (they used to be built first at every step). The
    order at a stall on real weights: tests/text/test_text_dager_minilm_polish.py."""
    batch = make_batch(bert_cls)
    search = _l2_search(bert_cls, _observe(bert_cls, batch, "classification"))
    true = batch.sequences()[0]
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})
    wrong = [*true[:2], next(v for v in vocab if v not in true), *true[3:]]
    with monkeypatch.context() as m:
        m.setattr(L2Search, "_polish_trials", lambda self, *a, **k: [])
        fixed = search.polish(wrong, vocab, max_len=len(true), config=PolishConfig(wide=0))
        stuck = search.polish(wrong, vocab, max_len=len(true), config=PolishConfig(wide=0, sweeps=False))
    assert fixed.seq == true and fixed.worst < search.threshold
    assert stuck.seq == wrong
    events: list[str] = []
    best, sweep = L2Search._best_trial, L2Search._sweep
    monkeypatch.setattr(L2Search, "_best_trial", lambda self, t, b: _mark(events, best(self, t, b)))
    monkeypatch.setattr(L2Search, "_sweep", lambda self, *a: events.append("sweep") or sweep(self, *a))
    broken = [true[0], *true[4:]]
    polished = search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig())
    assert polished.seq == true and events[0] != "sweep"
    assert all(events[i - 1] in ("stalled", "sweep") for i, e in enumerate(events) if e == "sweep")


def _mark(events: list[str], step: object) -> object:
    events.append("stalled" if step is None else "improved")
    return step


def test_wide_trials_are_every_edit_at_the_worst_sites_once():
    # brute force: every substitution at the 2 worst inner positions and every insertion next to them, each
    # sequence once (inserting a copy of a neighbour at either of its gaps is one sequence)
    cur, vocab = [101, 5, 6, 5, 102], [5, 6, 7]
    res = torch.tensor([0.0, 3.0, 1.0, 2.0, 0.0])
    out = L2Search._wide_trials(cur, res, vocab, 10, 2)
    expected = {tuple([*cur[:i], v, *cur[i + 1 :]]) for i in (1, 3) for v in vocab if v != cur[i]}
    expected |= {tuple([*cur[:g], v, *cur[g:]]) for g in (1, 2, 3, 4) for v in vocab}
    assert len(out) == len(expected) and set(map(tuple, out)) == expected
    full = L2Search._wide_trials(cur, res, vocab, len(cur), 2)  # at max_len: substitutions only
    assert len(full) == 4 and {tuple(t) for t in full} == {t for t in expected if len(t) == len(cur)}


def test_a_polish_that_reaches_a_remembered_walk_ends_where_it_ended(bert_cls, make_batch, monkeypatch):
    """``walks``: every sequence a walk passed through is remembered with its end and the loop passes it
    took (its steps and the stopping pass); a polish that reaches one with as many passes left returns
    that end without evaluating a trial, and it is the end a fresh polish from there reaches; with fewer
    passes left it walks on its own, and a walk cut off at ``steps`` is not remembered."""
    batch = make_batch(bert_cls)
    search = _l2_search(bert_cls, _observe(bert_cls, batch, "classification"))
    true = batch.sequences()[0]
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})
    broken = [true[0], *true[4:]]
    walks: dict = {}
    first = search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig(), walks=walks)
    assert first.seq == true and tuple(broken) in walks and len(walks) >= 3  # the walk's steps are remembered
    assert walks[tuple(true)][0] == 1 and walks[tuple(broken)][0] == len(walks)
    middle = next(list(k) for k, (left, _) in walks.items() if left == 2)  # one step before the end
    fresh = search.polish(middle, vocab, max_len=len(true) + 2, config=PolishConfig())
    calls: list[int] = []
    plain = L2Search._best_trial
    monkeypatch.setattr(L2Search, "_best_trial", lambda self, t, b: calls.append(1) or plain(self, t, b))
    for start in (broken, middle):
        again = search.polish(start, vocab, max_len=len(true) + 2, config=PolishConfig(), walks=walks)
        assert again == first and not calls
    assert fresh.seq == first.seq and fresh.objective == pytest.approx(first.objective, abs=1e-4)
    passes = walks[tuple(broken)][0]
    exact = search.polish(
        broken, vocab, max_len=len(true) + 2, config=PolishConfig(steps=passes), walks=walks
    )
    assert exact is first and not calls  # just as many passes left
    short = search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig(steps=1), walks=walks)
    alone = search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig(steps=1))
    assert calls and short.seq == alone.seq != true and walks[tuple(broken)][1] is first  # not remembered
    calls.clear()
    search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig(steps=passes - 1), walks=walks)
    assert calls  # one pass too few: it walks
    calls.clear()
    part = {k: v for k, v in walks.items() if v[0] <= 2}  # only the last two sequences of the walk
    again = search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig(), walks=part)
    assert calls and again is first and part[tuple(broken)] == walks[tuple(broken)]  # counts carried back


def test_encoder_polish_stops_once_it_echoes_a_held_sentence(bert_cls, make_batch):
    # The same broken sentence as above, now with the true sentence already held: the polish's first step
    # puts "was" back, after which half of its bigrams are the held sentence's, so it stops there instead
    # of finding the held sentence again. Holding only the other sentence, or stopping only at all of a
    # held sentence's bigrams (held_share 1), it goes on to the true sentence.
    from gradleak.attacks.text.dager.search import echoes

    batch = make_batch(bert_cls)
    search = _l2_search(bert_cls, _observe(bert_cls, batch, "classification"))
    true, other = batch.sequences()
    vocab = sorted({t for s in batch.sequences() for t in s[1:-1]})
    broken = [true[0], *true[4:]]
    assert not echoes(broken, true, 0.5)  # 2 of 6 bigrams: the polish starts
    stopped = search.polish(broken, vocab, max_len=len(true) + 2, config=PolishConfig(), held=[true])
    assert stopped.seq != true and stopped.worst >= search.threshold and echoes(stopped.seq, true, 0.5)
    for held, share in (([other], 0.5), ([true], 1.0)):
        polished = search.polish(
            broken, vocab, max_len=len(true) + 2, config=PolishConfig(held_share=share), held=held
        )
        assert polished.seq == true and polished.worst < search.threshold
    # checked before the first step: a start with 4 of 6 of the held sentence's bigrams comes back as it is
    start = [*true[:4], *true[5:]]  # "surprisingly" dropped
    assert search.polish(start, vocab, max_len=len(true), config=PolishConfig(), held=[true]).seq == start
    # bigrams, not tokens: the body reversed has every token of the held sentence and none of its bigrams,
    # so the polish runs
    mirrored = [true[0], *true[-2:0:-1], true[-1]]
    assert not echoes(mirrored, true, 0.5)
    moved = search.polish(mirrored, vocab, max_len=len(true), config=PolishConfig(), held=[true])
    assert moved.seq != mirrored


def test_echoes_counts_shared_bigrams_with_multiplicity():
    from gradleak.attacks.text.dager.search import echoes

    def reference(a, b, share):  # every bigram of a matched to an unused equal bigram of b
        pool = [tuple(b[j : j + 2]) for j in range(len(b) - 1)]
        common = 0
        for i in range(len(a) - 1):
            if tuple(a[i : i + 2]) in pool:
                pool.remove(tuple(a[i : i + 2]))
                common += 1
        return common >= share * max(len(a) - 1, len(b) - 1, 1)

    assert echoes([1, 2, 3, 4, 5], [1, 2, 3, 9, 5], 0.5)  # (1, 2) and (2, 3): 2 of 4
    assert not echoes([1, 2, 3, 4, 5], [1, 2, 3, 9, 5], 0.51)
    assert not echoes([7, 7, 7], [7, 7], 1.0)  # (7, 7) twice against once: 1 of 2
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        a, b = (torch.randint(4, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g) for _ in "ab")
        for share in (0.25, 0.5, 1.0):
            assert echoes(a.tolist(), b.tolist(), share) == reference(a.tolist(), b.tolist(), share)


def test_encoder_polish_recovers_a_batch_of_sentences_with_a_shared_first_word(bert_cls):
    # both sentences start with "long": each beam round leaves out the first words of the sentences it
    # already holds, so the second one is only reachable from a rejected closure that the polish repairs
    # (how often the plain beam alone gets there depends on rounding: that comparison is not a test)
    from gradleak.data.text import encode

    sents = ["long good film surprisingly was .", "long surprisingly it not . dull long"]
    batch = encode(sents, bert_cls.tokenizer, labels=[1, 0])
    obs = _observe(bert_cls, batch, "classification")
    end = int(bert_cls.tokenizer.sep_token_id)
    rec = Dager(DagerConfig(encoder=EncoderSearch(end_token_id=end))).reconstruct(
        obs, generator=_gen()
    )  # "polish" by default
    assert sorted(rec.token_ids) == sorted(batch.sequences())


@pytest.mark.parametrize(
    "sentences",
    [
        # a sentence that is a prefix of another one; a repeated sentence
        ("the movie was surprisingly good", "the movie was", "a dull and lifeless film ."),
        ("a dull and lifeless film .", "a dull and lifeless film .", "the movie was surprisingly good"),
    ],
)
def test_dager_causal_lm_returns_prefix_and_repeated_sentences(gpt2_lm, sentences):
    from gradleak.data.text import encode

    batch = encode(list(sentences), gpt2_lm.tokenizer, labels=[0, 0, 0])
    obs = _observe(gpt2_lm, batch, "causal_lm")
    # the decoder search closes a prefix only when nothing extends it, so it returns 2 of the 3 sentences
    plain = Dager(DagerConfig(decoder=DecoderSearch(prefix_sentences=False))).reconstruct(
        obs, generator=_gen()
    )
    assert len(plain.token_ids) == 2
    rec = Dager().reconstruct(obs, generator=_gen())
    assert sorted(rec.token_ids) == sorted(batch.sequences())
    assert rec.stats["prefix_sentences"] == 1.0


def test_prefix_sentences_adds_nothing_that_does_not_explain_the_head_gradient(gpt2_lm, make_batch):
    from gradleak.attacks.text.lm_completion import add_prefix_sentences

    batch = make_batch(gpt2_lm)
    obs = _observe(gpt2_lm, batch, "causal_lm")
    true_prefixes = [s[:-1] for s in batch.sequences()]
    # one sentence missing and no recovered prefix that contains it: no candidate fits, nothing is added
    assert add_prefix_sentences(obs, gpt2_lm.model, true_prefixes[:1], 1) == true_prefixes[:1]
    # both prefixes known: the one extra "sentence" the caller asks for does not exist either
    assert add_prefix_sentences(obs, gpt2_lm.model, true_prefixes, 1) == true_prefixes


def test_similar_is_relative_to_the_longer_sequence_and_held_ngrams():
    from gradleak.attacks.text.dager.search import held_ngrams, similar

    long = [101, 5, 6, 7, 8, 9, 10, 11, 12, 102]
    short = [101, 5, 6, 102]  # all its tokens occur in ``long``: not a variant of it
    assert not similar(long, short) and not similar(short, long)
    assert similar(long, [*long[:3], *long[4:]])  # one word dropped
    assert similar(long, [long[0], *long[2:5], long[1], *long[5:]])  # one word moved
    assert held_ngrams([[1, 2, 3, 4, 5]], 4) == {(1, 2, 3, 4), (2, 3, 4, 5)}
    assert held_ngrams([[1, 2, 3, 4, 5]], 0) == set()


def test_encoder_beam_grows_no_ngram_of_a_held_sentence(bert_cls, make_batch):
    from gradleak.attacks.text.dager.search import held_ngrams

    batch = make_batch(bert_cls)
    seqs = batch.sequences()
    search = _l2_search(bert_cls, _observe(bert_cls, batch, "classification"))
    end = int(bert_cls.tokenizer.sep_token_id)
    vocab = sorted({t for s in seqs for t in s[1:]})
    cands = [[seqs[0][0]]] + [vocab] * (max(len(s) for s in seqs) - 1)
    kw = {"end": end, "beam_width": 16, "per_prefix": 4, "batch": 2}
    found, _ = search.encoder_beam(cands, **kw)
    assert seqs[0] in [s for s, _ in found]  # control: without it the beam finds the sentence
    found, closures = search.encoder_beam(cands, **kw, held=[seqs[0]], ngram=4)
    grams = held_ngrams([seqs[0]], 4)
    grown = [s[:-1] for s, _ in found + closures]  # the closing [SEP] is not grown
    assert all(tuple(s[i : i + 4]) not in grams for s in grown for i in range(len(s) - 3))
    assert [s for s, _ in found] == [seqs[1]]  # the other sentence is still found


def test_novel_fraction_matches_a_least_squares_reference(bert_cls, make_batch):
    """f = ||P_S z - P_H P_S z|| / ||P_S z||, H = span of the held sentence's block-2 inputs (inside S);
    the reference solves the projection onto H by least squares in the model's own coordinates."""
    batch = make_batch(bert_cls)
    seqs = batch.sequences()
    search = _l2_search(bert_cls, _observe(bert_cls, batch, "classification"))
    search.novelty = 3.0
    z_held, z_other = search.whole_inputs(seqs)
    probe = torch.cat(
        [z_held, z_other, torch.randn(4, z_held.shape[1], generator=torch.Generator().manual_seed(0))]
    )
    plain = search.prefix_score(probe)
    assert torch.equal(plain, search.span.residual(probe))  # nothing held: the plain residual
    search.hold([seqs[0]])
    f = search.novel_fraction(probe)
    b = search.span.basis
    zs = probe.double() @ b @ b.T  # in-span parts
    h = z_held.double().T  # (d, n_held): H is spanned by these (all in S up to float error)
    hs = b @ (b.T @ h)
    coef = torch.linalg.lstsq(hs, zs.T).solution
    ref = (zs.T - hs @ coef).norm(dim=0) / zs.norm(dim=-1)
    assert torch.allclose(f, ref, atol=1e-6)
    assert float(f[: len(z_held)].max()) < 1e-6  # the held sentence's own inputs: nothing novel
    assert float(f[len(z_held) : len(z_held) + len(z_other)].mean()) > 0.3  # the other sentence's
    assert torch.allclose(search.prefix_score(probe), plain * torch.exp(-3.0 * f))
    search.hold([])
    assert torch.equal(search.prefix_score(probe), plain)

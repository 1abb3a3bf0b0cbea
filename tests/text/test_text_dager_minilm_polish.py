"""The encoder polish on real weights and real text: all-MiniLM-L6-v2, a WikiText-2 batch (B = 8).

A sentence with a two-token word missing ("' s") is off everywhere (under bidirectional attention every
position's block-2 input shifts), so the per-site screen ranks the missing token low at its gap (24th of
92 measured) while the exact whole-sequence objective ranks it first; the polish with its stall step
(the two sweeps, then every token at the worst positions, the ``keep`` closest to the feed-forward screen's
span evaluated exactly where the search has that screen) restores the sentence. Once other sentences are
held, the novelty-weighted prefix score grows the missing sentence. (How the screened steps alone or the
plain residual fare depends on the CPU's rounding; such comparisons are not tests; the stall step's order
is checked on the path this repair takes under each kernel the suite runs.)
"""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.text.dager.core import Dager
from gradleak.attacks.text.dager.search import L2Search, PolishConfig
from gradleak.attacks.text.family import estimate_span, family_of, find_module, input_side_gradient
from gradleak.data.text import encode, load_text_dataset, sample
from gradleak.models.text import build_text_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation


@pytest.fixture(scope="module")
def wikitext_minilm():
    tm = build_text_model("minilm", "classification", seed=0)
    picked = sample(load_text_dataset("wikitext2", split="test"), 8, seed=0)
    batch = encode(list(picked.texts), tm.tokenizer, max_tokens=32, labels=[0] * 8)
    obs = Observation(tm.model, fedsgd_text_update(tm.model, batch, "classification"), (32,), 2)
    spec = family_of(tm.model)
    span2 = estimate_span(input_side_gradient(obs, tm.model, spec.attn_inputs, 1), spec.rank_tol)
    m1, m2 = (find_module(tm.model, spec.attn_inputs[0].format(i=i))[1] for i in (0, 1))
    search = L2Search(tm.model, m2, span2, spec.l2_threshold, first=m1)
    # the same search as the attack runs it: block 1 from tables, the feed-forward screen on
    screened = L2Search(tm.model, m2, span2, spec.l2_threshold, first=m1)
    screened.tabulate(sorted({t for s in batch.sequences() for t in s}), 32)
    screened.screen = Dager().feed_forward_span(obs, tm.model, screened, spec, span2)
    assert screened.screen is not None
    return tm, batch.sequences(), search, screened


def _plain(fixture):
    tm, seqs, search, _ = fixture
    return tm, seqs, search


@pytest.mark.parametrize("screened", [False, True], ids=["every-trial-exact", "screened"])
def test_polish_stall_step_restores_a_missing_two_token_word(wikitext_minilm, monkeypatch, screened):
    tm, seqs, plain, tabled = wikitext_minilm
    search = tabled if screened else plain
    apostrophe = tm.tokenizer.convert_tokens_to_ids("'")
    true = next(s for s in seqs if len(s) == 32 and apostrophe in s and tm.tokenizer.decode(s[1:2]) == "for")
    q = true.index(apostrophe)
    broken = [*true[:q], *true[q + 2 :]]  # "... < unk > ' s division" -> "... < unk > division"
    vocab = sorted({t for s in seqs for t in s[1:-1]})
    events: list[str] = []
    evaluated: list[int] = []  # trials each exact evaluation took
    widths: list[int] = []  # wide trials each stall built
    best, sweep, wide_trials = L2Search._best_trial, L2Search._sweep, L2Search._wide_trials

    def best_trial(self, trials, b):
        step = best(self, trials, b)
        events.append("stalled" if step is None else "improved")
        evaluated.append(len(trials))
        return step

    def wide_built(*a):
        out = wide_trials(*a)
        events.append("wide")
        widths.append(len(out))
        return out

    with monkeypatch.context() as m:
        m.setattr(L2Search, "_best_trial", best_trial)
        m.setattr(L2Search, "_sweep", lambda self, *a: events.append("sweep") or sweep(self, *a))
        m.setattr(L2Search, "_wide_trials", staticmethod(wide_built))
        wide = search.polish(broken, vocab, max_len=32, config=PolishConfig())
    assert wide.seq == true and wide.worst < search.threshold
    assert torch.isfinite(torch.tensor(wide.objective)) and wide.objective < -5  # rounding-noise level
    # a stall tries the two sweeps (one exact evaluation), then, only where they do not improve, the wide
    # trials; no sweep anywhere else
    starts = [i for i, e in enumerate(events) if e == "sweep" and events[i - 1] != "sweep"]
    assert starts and starts[0] > 0 and all(events[i - 1] == "stalled" for i in starts)
    for i in starts:
        assert events[i : i + 2] == ["sweep", "sweep"] and events[i + 2] in ("stalled", "improved")
        after = events[i + 3] if i + 3 < len(events) else None
        assert (after == "wide") == (events[i + 2] == "stalled")
    assert events.count("sweep") == 2 * len(starts)
    # under the feed-forward screen (the attack's setting) only the ``keep`` wide trials closest to its span
    # are evaluated exactly, and the one that restores the word is among them; without it, all of them
    keep = PolishConfig().keep
    stalls = [i for i, e in enumerate(events) if e == "wide"]
    assert stalls and all(w > keep for w in widths)
    for i, width in zip(stalls, widths, strict=True):
        k = sum(e in ("stalled", "improved") for e in events[:i])  # exact evaluations before this one
        assert evaluated[k] == (keep if screened else width)


def test_novelty_score_grows_the_missing_sentence_instead_of_echoes_of_held_ones(wikitext_minilm):
    """Seven of the eight sentences held, the beam starts from the missing one's first word ("for").
    Novelty-weighted (exp(-3 f)): 40 % of the missing sentence's tokens in the best closure measured; the
    plain L2 residual re-grows pieces of held sentences (10 % measured on one machine; a comparison
    between the two depends on rounding and is not asserted).
    """
    from collections import Counter

    tm, seqs, search = _plain(wikitext_minilm)
    miss = next(s for s in seqs if tm.tokenizer.decode(s[1:4]) == "for the french")
    held = [s for s in seqs if s is not miss]
    vocab = sorted({t for s in seqs for t in s[1:]})
    cands = [[miss[0]], [miss[1]]] + [vocab] * 30
    search.novelty = 3.0
    search.hold(held)
    try:
        found, closures = search.encoder_beam(
            cands, end=tm.tokenizer.sep_token_id, beam_width=64, per_prefix=4, batch=8, held=held
        )
    finally:
        search.novelty = 0.0
        search.hold([])
    best = (found + closures)[0][0]
    common = sum((Counter(best[1:-1]) & Counter(miss[1:-1])).values())
    share = common / max(len(best) - 2, len(miss) - 2)
    assert share > 0.2, share  # 0.40 measured; a beam's best closure is discrete, so the bar is loose

"""SOMP as read here (issue 53): DAGER's token test, then simultaneous OMP over block 2's head blocks, on the
2-layer GPT-2 (64 wide, 4 heads) with the real tokenizer."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import null_observation
from gradleak.attacks.text.family import Span, family_of, input_side_gradient
from gradleak.attacks.text.lm_prior import LMPriorConfig
from gradleak.attacks.text.somp import HeadPool, SompConfig
from gradleak.data.text import encode
from gradleak.metrics.text import decode, score_texts
from gradleak.models import build_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import AttackInputError, Observation, Update

REVIEWS = [
    "the film was great fun", "a dull and boring movie", "it was fun to watch with friends",
    "the acting is wooden and the plot thin", "an utterly charming little comedy",
    "i did not like the ending at all", "a masterpiece of quiet menace", "too long by half and never funny",
    "she steals every scene she is in", "the score is lovely but the script is weak",
    "nothing here you have not seen before", "brave bold and often very moving",
]  # fmt: skip


@pytest.fixture(scope="module")
def gpt2():
    return build_model("gpt2_tiny", (16,), 2, task="causal_lm", seed=0)


def run(obs: Observation, **options) -> list[list[int]]:
    attack = create_attack("somp", **options)
    return attack.reconstruct(obs, generator=torch.Generator().manual_seed(0)).token_ids


@pytest.mark.parametrize(
    "texts",
    [
        ["the film was great fun"],
        ["great fun", "a dull movie"],
        ["the film was great fun", "a dull and boring movie", "it was fun"],
        ["the film was great fun", "the film was dull and boring"],  # a shared prefix branches
        REVIEWS[:8],
    ],
)
def test_every_sentence_comes_back_exactly(observe_lm, gpt2, texts):
    obs, true = observe_lm(gpt2, texts)
    assert sorted(run(obs)) == sorted(true)


def test_a_null_update_gives_none_of_the_words(observe_lm, gpt2):
    """Noise of the update's norms fills both spans; nothing the embedding rows' noise keeps stands out from
    chance on block 2: none of the batch's words."""
    obs, true = observe_lm(gpt2, ["the film was great fun", "a dull and boring movie"])
    got = run(null_observation(obs, torch.Generator().manual_seed(1)))
    scores = score_texts(decode(gpt2.tokenizer, got), decode(gpt2.tokenizer, true), with_meteor=False)
    assert scores.rouge1 == 0.0


def test_the_score_is_simultaneous_omps_pooled_over_heads(observe_lm, gpt2):
    """HeadPool's score of an atom against a slow reference: the mean over heads of ||R_h^T a||^2 / ||a||^2,
    R_h the unit-normalised head block minus its least-squares fit on the chosen atoms."""
    obs, _ = observe_lm(gpt2, REVIEWS[:3])
    grad = input_side_gradient(obs, gpt2.model, family_of(gpt2.model).attn_inputs, 1)
    pool = HeadPool(grad, 16)
    assert pool.heads == 12  # Q, K and V of 4 heads
    gen = torch.Generator().manual_seed(0)
    atoms = torch.randn(3, 64, generator=gen, dtype=torch.float64)
    pool.add(atoms[0], 1e-3)
    pool.add(atoms[1], 1e-3)
    chosen = atoms[:2].T
    ref = []
    for block in grad.to(torch.float64).split(16, dim=1):
        block = block / block.norm()
        resid = block - chosen @ torch.linalg.lstsq(chosen, block).solution
        ref.append(float((resid.T @ atoms[2]).pow(2).sum() / atoms[2].pow(2).sum()))
    assert float(pool.scores(atoms[2:], 1e-3)[0]) == pytest.approx(sum(ref) / len(ref), rel=1e-9)
    # an atom in the chosen span adds no direction
    assert float(pool.scores((atoms[0] + 2 * atoms[1]).unsqueeze(0), 1e-3)[0]) == 0.0


def test_the_true_block_2_inputs_explain_the_whole_gradient(observe_lm, gpt2):
    """After the attack, the chosen atoms (the true prefixes' block-2 inputs) explain the pooled gradient."""
    obs, _ = observe_lm(gpt2, REVIEWS[:4])
    out = create_attack("somp").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert out.stats["explained_l2"] == pytest.approx(1.0, abs=1e-9)
    assert out.stats["heads"] == 12


def test_omp_alone_orders_two_sentences(observe_lm, gpt2):
    """With the L2 test off (threshold 0.999: every extension admissible), OMP's scores and the cap of B
    live prefixes decide alone, and two sentences of one length come back in order. Where they end is not
    decided here: with the L2 test off no admissible extension is refused (unequal lengths fail)."""
    obs, true = observe_lm(gpt2, REVIEWS[:2])
    assert sorted(run(obs, l2_threshold=0.999)) == sorted(true)


def test_through_half_the_entries_pruned_the_embedding_rows_and_omp_read_the_sentence(observe_lm, gpt2):
    """Prune-50 % (a seeded mask) fills both spans, so DAGER's tests cannot discriminate. SOMP takes the
    embedding rows' tokens at every position, and OMP against chance (``chance_ratio`` 2) grows the one
    sentence exactly: the pruned gradient's energy still lies along the true block-2 inputs."""
    obs, true = observe_lm(gpt2, REVIEWS[:1])
    gen = torch.Generator().manual_seed(0)
    kept = {k: v * (torch.rand(v.shape, generator=gen) < 0.5) for k, v in obs.update.tensors.items()}
    pruned = Observation(gpt2.model, Update(kept, kind="gradient", num_samples=1), obs.input_shape, 50257)
    out = create_attack("somp").reconstruct(pruned, generator=torch.Generator().manual_seed(0))
    assert out.stats["rows_fallback"] == 1.0
    assert out.token_ids == true


def test_what_it_cannot_read_is_refused_before_work(observe_lm, gpt2):
    bert = build_model("bert_tiny", (16,), 2, seed=0)
    batch = encode(["the film was great fun"], bert.tokenizer, labels=[1], max_tokens=16)
    update = fedsgd_text_update(bert.model, batch, "classification")
    with pytest.raises(AttackInputError, match="causal language model"):
        run(Observation(bert.model, update, (16,), 2))
    obs, _ = observe_lm(gpt2, ["the film was great fun"])
    delta = Update({k: -v for k, v in obs.update.tensors.items()}, kind="delta", num_samples=1)
    with pytest.raises(AttackInputError, match="FedAvg delta"):
        run(Observation(gpt2.model, delta, obs.input_shape, 50257))
    with pytest.raises(ValueError, match="go together"):
        SompConfig(prior_weight=0.5)
    with pytest.raises(ValueError, match="min_score"):
        SompConfig(min_score=0.0)
    with pytest.raises(ValueError, match="chance_ratio"):
        SompConfig(chance_ratio=0.5)
    with pytest.raises(ValueError, match="prior.context"):
        SompConfig(prior=LMPriorConfig(tokenizer="gpt2_tiny", kind="gpt2", context=32), prior_weight=1.0)


def test_rotary_positions_and_grouped_query_heads(tiny_llama):
    """A 2-block Llama (rotary positions, 4 query heads sharing 2 key/value heads, tied head): Q's 4 heads and
    K's and V's 2 each make 8 blocks of 16 columns; both sentences come back exactly."""
    seqs = [[17, 42, 101, 7, 250, 99], [5, 42, 180, 33, 2]]
    obs = tiny_llama(seqs, kv_heads=2)
    out = create_attack("somp").reconstruct(obs, generator=torch.Generator().manual_seed(0))
    assert sorted(out.token_ids) == sorted(seqs)
    assert out.stats["heads"] == 8


def test_the_prior_scores_each_extended_prefix_and_the_score_still_decides(observe_lm, gpt2, monkeypatch):
    """LM guidance: the prior is asked for the mean NLL of every extended prefix (never of a lone first token)
    and ranks the atoms; a prior that prefers every wrong token (NLL 0 for wrong, 50 for true) changes no
    sentence here: each level's admissible atoms are the true extensions."""
    from gradleak.attacks.text import somp

    texts = ["the film was great fun", "a dull and boring movie", "it was fun"]
    obs, true = observe_lm(gpt2, texts)
    prefixes = {tuple(s[:i]) for s in true for i in range(2, len(s) + 1)}
    calls: list[torch.Tensor] = []

    class Spy:
        def nll(self, ids: torch.Tensor) -> torch.Tensor:
            calls.append(ids)
            return torch.tensor([50.0 if tuple(r) in prefixes else 0.0 for r in ids.tolist()])

    monkeypatch.setattr(somp, "load_prior", lambda config: Spy())
    got = run(obs, prior={"tokenizer": "gpt2_tiny"}, prior_weight=1.0)
    assert sorted(got) == sorted(true)
    assert calls and all(c.shape[1] >= 2 for c in calls)
    assert any(tuple(r) in prefixes for c in calls for r in c.tolist())


def test_each_live_prefix_gets_its_best_extension_before_any_branches():
    """A synthetic level: prefix 0's true extension explains most of the gradient, prefix 1's a little; a
    wrong extension of prefix 0 correlates with a later level's input and outscores prefix 1's true one.
    Under the cap of B = 2, prefix 1 keeps its extension (by hand, without ``parents``: prefix 0's
    wrong extension took its place)."""
    from gradleak.attacks.text.family import Span
    from gradleak.attacks.text.somp import OmpSearch

    d = 64
    e = torch.eye(d, dtype=torch.float64)
    grad = torch.stack([10 * e[0] + 1 * e[1] + 3 * e[3]] * 4, dim=1)  # one head of 4 columns
    atoms = torch.stack([e[0], e[1], (e[2] + e[3]) / 2**0.5])  # true of 0, true of 1, wrong of 0
    seqs = [[1, 10], [2, 20], [1, 30]]
    pool = HeadPool(grad, 4)
    search = OmpSearch(None, None, Span(e, torch.ones(d)), 0.5, pool=pool, batch=2)  # type: ignore[arg-type]
    picked = search.pick(seqs, atoms, torch.ones(3, dtype=torch.bool), {}, torch.tensor([0, 1, 0]))
    assert picked == [[1, 10], [2, 20]]


def _synthetic(atoms: dict[tuple[int, ...], torch.Tensor], grad: torch.Tensor, span: Span, batch: int):
    """An OmpSearch over hand-made block-2 inputs (``atoms`` by prefix; an extension never repeats)."""
    from gradleak.attacks.text.somp import OmpSearch

    class Synthetic(OmpSearch):
        def block2_inputs(self, seqs: torch.Tensor) -> torch.Tensor:
            return torch.stack([atoms[tuple(s)] for s in seqs.tolist()]).unsqueeze(1)

        def extension_inputs(self, prefixes, cands):
            z = torch.stack([atoms[(*s, v)] for s in prefixes for v in cands])
            return z, torch.stack([-atoms[tuple(s)] for s in prefixes for _ in cands])

    return Synthetic(None, None, span, 0.5, pool=HeadPool(grad, 4), batch=batch)  # type: ignore[arg-type]


def test_extend_serves_each_live_prefix_through_its_own_extensions():
    """Through ``extend``: two first tokens, three candidates after each. Prefix 1's wrong extension (1, 20)
    outscores prefix 2's true (2, 20); each prefix is served from its own extensions (parents aligned with
    the prefix-outer, candidate-inner order)."""
    d = 64
    e = torch.eye(d, dtype=torch.float64)
    atoms = {(1,): e[4], (2,): e[5], (1, 10): e[0], (1, 20): (e[2] + e[3]) / 2**0.5, (1, 30): e[7],
             (2, 10): e[6], (2, 20): e[1], (2, 30): e[7] + e[6]}  # fmt: skip
    grad = torch.stack([10 * e[0] + e[1] + 3 * e[3] + 5 * e[4] + 4 * e[5]] * 4, dim=1)
    search = _synthetic(atoms, grad, Span(e, torch.ones(d)), batch=2)
    found = search.extend([[1, 2], [10, 20, 30]], "greedy", 64)
    assert sorted(s for s, _ in found) == [[1, 10], [2, 20]]


@pytest.mark.parametrize("twin", [1e-5, 1.0])
def test_where_the_l2_test_accepts_a_prefix_grows_whatever_its_score(twin):
    """Block 2's span not full: prefix 2's true extension is (nearly or exactly) the input prefix 1's already
    explains, so it scores ~0 (a repeated "<unk>" on SmolLM2 closed its sentence this way); it grows anyway,
    an exactly parallel atom leaves the basis as it was, and prefix 1's branch (1, 30) is still picked."""
    d = 64
    e = torch.eye(d, dtype=torch.float64)
    twin_atom = e[0] + 1e-5 * e[5] if twin < 1 else 2 * e[0]
    search = _synthetic({}, torch.stack([10 * e[0] + 3 * e[2]] * 4, dim=1), Span(e[:, :8], torch.ones(8)), 3)
    assert search.pool is not None
    atoms = torch.stack([e[0], twin_atom, e[2]])
    got = search.pick(
        [[1, 10], [2, 20], [1, 30]], atoms, torch.ones(3, dtype=torch.bool), {}, torch.tensor([0, 1, 0])
    )
    assert got == [[1, 10], [2, 20], [1, 30]]
    assert torch.isfinite(search.pool.basis).all()
    assert search.pool.basis.shape[1] == 2  # e0 and e2: the twin added no direction

"""``audit.views``: the server broadcasts the audited model several times; each time the audited clients
train on the same samples with fresh randomness, and honest-server attacks get the repeats as views."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.experiments import load_config, run_experiment
from gradleak.experiments.config import ConfigError
from gradleak.experiments.runner import audited_updates

TINY = [
    "data.train_limit=600", "data.test_limit=200", "data.num_clients=10", "fl.rounds=1", "fl.fraction=0.2",
    "fl.training.epochs=1", "audit.training.batch_size=2", "audit.max_samples=2", "audit.pick='random'",
    "audit.clients=2", "audit.views=3",
]  # fmt: skip


def cfg(*extra: str):
    from gradleak.cli.demo import demo_config_path

    return load_config(demo_config_path(), TINY + list(extra))


def test_without_noise_every_view_is_the_same_update_of_the_same_samples():
    """FedSGD on the same (randomly picked) samples from the same model: with no defense the three views
    are one gradient, bit for bit, so the repeats train on the audited samples, not others (that each view
    has a seed of its own is the next test's: identical seeds would pass this one)."""
    pairs = audited_updates(cfg())
    assert len(pairs) == 2
    for obs, truth in pairs:
        assert len(obs.views) == 2 and len(truth) == 2
        for view in obs.views:
            assert view.metadata["client_id"] == obs.update.metadata["client_id"]
            for name, t in obs.update.tensors.items():
                assert torch.equal(view.tensors[name], t)


def test_under_noise_every_view_draws_its_own_noise_of_the_stated_scale():
    """batch_noise with sigma 0.01 (clip 1): two views differ by noise of std sqrt(2) x 0.01 (over 1.9 M
    entries the estimate's relative sd is 5e-4; tolerance 1 %), and no two views share a draw."""
    pairs = audited_updates(cfg("defenses=[{name='batch_noise', clip=1.0, sigma=0.01, batch_size=1}]"))
    for obs, _ in pairs:
        s = obs.update.metadata["batch_noise/noise_std"]
        assert s == pytest.approx(0.01)
        flats = [u.flat() for u in (obs.update, *obs.views)]
        for a, b in ((0, 1), (0, 2), (1, 2)):
            assert float((flats[a] - flats[b]).std()) == pytest.approx(math.sqrt(2) * s, rel=0.01)


def test_the_audit_records_the_views_and_the_averaging_attack_uses_them():
    """Each attack record says how many views the server had; ig_noise with average_views says it matched
    their mean, at the stated scale / sqrt(3)."""
    run = run_experiment(cfg(
        "defenses=[{name='batch_noise', clip=1.0, sigma=0.001, batch_size=1}]",
        "audit.attacks=[{name='ig_noise', max_iterations=2}, {name='ig_noise', max_iterations=2, "
        "average_views=true}]",
    ))  # fmt: skip
    records = run.of_kind("attack")
    assert len(records) == 4 and all(r["views"] == 3 for r in records)
    one, mean = [r for r in records if r["cell"] == 0], [r for r in records if r["cell"] == 1]
    assert all(r["views_averaged"] == 1 and r["noise_std"] == pytest.approx(0.001) for r in one)
    assert all(r["views_averaged"] == 3 for r in mean)
    assert all(r["noise_std"] == pytest.approx(0.001 / math.sqrt(3)) for r in mean)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["audit.views=0"], "audit.views must be an int >= 1"),
        (["audit.views=true"], "audit.views: expected int"),
        (["fl.secure_aggregation=true"], "secure_aggregation shows the server only their sum"),
        (["audit.max_samples=3"], "draws its batch of 2 afresh from its 3 audited samples"),
    ],
)
def test_bad_views_are_refused_before_any_work(extra, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*extra)


def test_fedsgd_views_without_a_sample_cap_are_refused():
    """Without audit.max_samples a FedSGD client would draw another batch of its share for every view."""
    from gradleak.cli.demo import demo_config_path

    uncapped = [o for o in TINY if not o.startswith("audit.max_samples")]
    with pytest.raises(ConfigError, match="draws its batch of 2 afresh from all its samples"):
        load_config(demo_config_path(), uncapped)
    fedavg = load_config(demo_config_path(), [*uncapped, "audit.training.protocol='fedavg'"])
    assert fedavg.audit.views == 3  # FedAvg trains on all of them in every view


def test_formal_privacy_is_charged_for_every_view():
    """DP-SGD at epsilon 8 for one step, broadcast three times: each view states 8; the three together are
    the accountant's epsilon of three such steps (Opacus' RDP accountant, computed here from the stated
    sigma and sampling rate), and the record says so beside the per-view figure."""
    from gradleak.defenses.base import composed_claims
    from gradleak.defenses.dp_sgd import epsilon

    config = cfg("defenses=['dp_sgd_eps8']", "audit.attacks=[{name='ig', max_iterations=2}]")
    (obs, _), _ = audited_updates(config)
    m = obs.update.metadata
    assert m["dp_sgd/epsilon"] == pytest.approx(8.0, rel=0.01) and m["dp_sgd/steps"] == 1
    three = epsilon(m["dp_sgd/noise_multiplier"], m["dp_sgd/sample_rate"], 3, 1e-5)
    assert 8.5 < three < 3 * 8.0  # composition costs, and RDP beats adding the epsilons
    claims = composed_claims([u.metadata for u in (obs.update, *obs.views)])
    assert claims == {"epsilon": pytest.approx(three, rel=1e-9), "delta": 1e-5}
    (record, _) = run_experiment(config).of_kind("attack")
    assert record["epsilon"] == pytest.approx(m["dp_sgd/epsilon"], rel=1e-9)
    assert record["epsilon_views"] == pytest.approx(three, rel=1e-9) and record["views"] == 3


def test_update_dp_composes_by_adding_and_a_claim_without_a_rule_is_refused():
    from gradleak.defenses.base import composed_claims

    release = {"update_noise/epsilon": 0.5, "update_noise/delta": 1e-5, "update_noise/noise_std": 0.1}
    assert composed_claims([release] * 4) == {"epsilon": pytest.approx(2.0), "delta": pytest.approx(4e-5)}
    assert composed_claims([{"batch_noise/noise_std": 0.1}] * 4) == {}
    with pytest.raises(ValueError, match="no composition rule"):
        composed_claims([{"mine/epsilon": 1.0, "mine/delta": 1e-5}])


def test_dp_sgd_views_compose_with_the_accountant_that_stated_them():
    """A release's epsilon stated by Opacus' PRV accountant composes by the same accountant (RDP would
    state another figure); releases by different accountants are not composed."""
    from gradleak.defenses.base import composed_claims
    from gradleak.defenses.dp_sgd import epsilon

    release = {"dp_sgd/epsilon": epsilon(0.9, 1.0, 1, 1e-5, "prv"), "dp_sgd/delta": 1e-5,
               "dp_sgd/steps": 1, "dp_sgd/sample_rate": 1.0, "dp_sgd/noise_multiplier": 0.9,
               "dp_sgd/accountant": "prv"}  # fmt: skip
    prv = epsilon(0.9, 1.0, 8, 1e-5, "prv")
    assert composed_claims([release] * 8)["epsilon"] == pytest.approx(prv, rel=1e-9)
    assert abs(prv - epsilon(0.9, 1.0, 8, 1e-5, "rdp")) > 0.1  # the accountant matters here
    with pytest.raises(ValueError, match="different accountants"):
        composed_claims([release, {**release, "dp_sgd/accountant": "rdp"}])


def test_a_repeat_that_failed_closed_is_left_out_and_the_record_says_how_many_views_there_were():
    from gradleak.experiments.runner import with_views
    from gradleak.tasks.client import ClientResult

    (obs, _), _ = audited_updates(cfg())
    cid = obs.update.metadata["client_id"]
    sent = ClientResult(cid, obs.update)
    repeats = [[ClientResult(cid, None, error="defense failed")], [ClientResult(cid + 1, obs.update), sent]]
    assert with_views(obs, repeats).views == (obs.update,)  # the failed one and another client's left out


def test_malicious_model_attacks_see_one_round_and_views_need_an_attack_that_reads_them():
    """robbing_the_fed beside IG with audit.views = 3: the malicious cell's records carry no views (its
    observation has none), the honest cell's do; an audit of malicious attacks only, or average_views
    without views, is refused before any work."""
    run = run_experiment(cfg(
        "audit.attacks=[{name='ig', max_iterations=2}, {name='robbing_the_fed', num_bins=8}]",
        "audit.training.protocol='fedavg'",
    ))  # fmt: skip
    records = run.of_kind("attack")
    assert {r["attack"] for r in records} == {"ig", "robbing_the_fed"}
    assert all(r["views"] == 3 for r in records if r["attack"] == "ig")
    assert all("views" not in r for r in records if r["attack"] == "robbing_the_fed")
    with pytest.raises(ConfigError, match="every attack of the audit modifies the model"):
        cfg("audit.attacks=[{name='robbing_the_fed', num_bins=8}]", "audit.training.protocol='fedavg'")
    with pytest.raises(ConfigError, match=r"audit.attacks\[0\] averages views, but audit.views = 1"):
        cfg("audit.attacks=[{name='ig_noise', average_views=true}]", "audit.views=1")


def test_a_text_audit_averages_views_through_the_runner():
    """GPT-2 arch tiny, WikiText-2, two clients' FedSGD batches of 2 sequences, each gradient plus
    N(0, (2.83e-5)^2) per entry (batch_noise without clipping), 8 views: dager_spectral on one view recovers
    a fifth of the tokens, on the mean of the 8 (noise 1e-5) nearly every sequence; each beside its null
    floor, which reads noise views only (0). Measured R-1: one view 0.22 / 0.17, the mean 1.00 / 0.97."""
    from pathlib import Path

    wiki = Path(__file__).resolve().parents[2] / "examples" / "wikitext2_gpt2_dager.toml"
    config = load_config(wiki, [
        "data.train_limit=120", "data.test_limit=40", "data.num_clients=6", "fl.fraction=0.5", "fl.rounds=0",
        "audit.max_samples=2", "audit.views=8",
        "defenses=[{name='batch_noise', clip=1e6, sigma=2.83e-11, batch_size=1}]",
        "audit.attacks=[{name='dager_spectral', max_positions=16}, "
        "{name='dager_spectral', max_positions=16, average_views=true}]",
    ])  # fmt: skip
    records = run_experiment(config).of_kind("attack")
    one = sorted((r for r in records if r["cell"] == 0), key=lambda r: r["client_id"])
    mean = sorted((r for r in records if r["cell"] == 1), key=lambda r: r["client_id"])
    assert [r["client_id"] for r in one] == [r["client_id"] for r in mean] and len(one) == 2
    for a, b in zip(one, mean, strict=True):
        assert a["views"] == b["views"] == 8 and a["views_averaged"] == 1 and b["views_averaged"] == 8
        assert b["noise_std"] == pytest.approx(2.83e-5 / math.sqrt(8), rel=1e-6)
        assert a["rouge1"] < 0.4 and b["rouge1"] > 0.9 and b["rouge1"] - a["rouge1"] > 0.5, (a, b)
        assert a["floor_null_rouge1"] == b["floor_null_rouge1"] == 0.0

"""Adversarial reply fuzzing (:mod:`gradleak.integrations.flower.fuzzing`): over 1,000 seeded hostile or
malformed replies through each audit wrapper around Flower's own FedAvg, no round aborts, every round's
aggregate equals the FedAvg of the well-formed replies alone (float32 rounding: relative 1e-5), every
malformed reply is recorded with its node and reason, and no well-formed one is rejected. The fuzzer can
fail: with one check of the wrapper switched off it reports the forged counts it let through."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("flwr")

from gradleak.integrations.flower import legacy, replies  # noqa: E402
from gradleak.integrations.flower.fuzzing import fuzz_legacy_api, fuzz_message_api  # noqa: E402


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)  # a thousand rejections, each logged
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("fuzz", [fuzz_message_api, fuzz_legacy_api])
def test_a_thousand_hostile_replies_never_abort_or_reach_the_aggregate(fuzz):
    reports = [fuzz(seed, rounds=40) for seed in (0, 1, 2)]
    assert sum(r.replies for r in reports) >= 1000
    assert sum(r.malformed for r in reports) >= 400 and sum(r.well_formed for r in reports) >= 400
    for r in reports:
        assert r.ok, r.as_dict()
        assert r.max_abs_diff < 1e-5
        assert len(r.mutations) >= 12  # every kind of mutation was drawn


def test_the_fuzzer_finds_a_wrapper_that_trusts_sample_counts(monkeypatch):
    monkeypatch.setattr(
        replies, "sample_count", lambda value, bound, source: int(value) if value == value else 1
    )
    report = fuzz_message_api(0, rounds=40)
    assert not report.ok and (report.mismatched_rounds or report.aborts or report.unrecorded)


def test_the_fuzzer_finds_a_legacy_wrapper_that_skips_the_array_check(monkeypatch):
    monkeypatch.setattr(legacy, "check_reply", _unchecked)
    report = fuzz_legacy_api(0, rounds=10)
    assert not report.ok


def _unchecked(**kwargs):
    from gradleak.integrations.flower.replies import CheckedReply
    from gradleak.types import Update

    n = kwargs["num_examples"]
    return CheckedReply(kwargs["node"], dict(kwargs["arrays"]), Update({}, 1), n if n > 0 else 1, {})

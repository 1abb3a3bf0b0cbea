"""The deployment audit's verdict lines (experiments/verdicts.py): each rule on the record it is for."""

from __future__ import annotations

from gradleak.experiments.verdicts import node_verdicts, verdict, withheld_lines
from gradleak.metrics.floors import LEAKS_ABOVE_DB

BASE = {"kind": "attack", "round": 2, "node_id": 7, "attack": "ig"}


def test_each_rule_names_itself():
    cases = [
        ({"kind": "rejected", "round": 1, "node_id": 3, "error": "num-examples 1e18"}, "rule 1"),
        ({"kind": "client_error", "round": 1, "node_id": 3, "error": "boom"}, "failed on the client"),
        ({**BASE, "kind": "attack_error", "error": "oops"}, "rule 2"),
        ({**BASE, "refused": "all zeros"}, "refused the update (rule 2)"),
        ({**BASE, "psnr_mean_beyond_floor": LEAKS_ABOVE_DB + 0.5, "psnr_mean": 20.0}, "LEAKS to ig"),
        ({**BASE, "psnr_mean_beyond_floor": LEAKS_ABOVE_DB, "psnr_mean": 20.0}, "no leakage above the floor"),
        ({**BASE, "psnr_mean": 14.2}, "rule 4"),
        ({**BASE, "matching_loss": 0.12}, "rule 5"),
    ]
    for record, words in cases:
        assert words in verdict(record), (record, verdict(record))


def test_a_text_record_is_judged_by_paper_002s_blocked_rule_against_its_null():
    """Leaks unless ROUGE-1 <= max(0.05, null + 0.05) (attacks.text.baseline.is_blocked): the boundary
    both ways, a null that lifts the bar, no null (rule 4) and a non-finite score (rule 2)."""
    text = {**BASE, "attack": "dager_lora"}
    leak = verdict({**text, "rouge1": 0.051, "floor_null_rouge1": 0.0})
    assert "LEAKS to dager_lora: ROUGE-1 0.051 against 0.000" in leak
    assert "no leakage above the floor" in verdict({**text, "rouge1": 0.05, "floor_null_rouge1": 0.0})
    assert "no leakage above the floor" in verdict({**text, "rouge1": 0.30, "floor_null_rouge1": 0.26})
    assert "LEAKS" in verdict({**text, "rouge1": 0.32, "floor_null_rouge1": 0.26})
    assert "no null floor to compare (rule 4)" in verdict({**text, "rouge1": 0.9})
    assert "no finite score (rule 2)" in verdict({**text, "rouge1": float("nan"), "floor_null_rouge1": 0.0})


def test_the_threshold_is_strict_and_one_sided():
    at = verdict({**BASE, "psnr_mean_beyond_floor": LEAKS_ABOVE_DB})
    above = verdict({**BASE, "psnr_mean_beyond_floor": LEAKS_ABOVE_DB + 1e-9})
    assert "a stronger attack may still leak" in at and "LEAKS" in above


def test_a_verdict_shows_the_nodes_score_beside_both_floors():
    r = {**BASE, "psnr_mean_beyond_floor": -4.25, "psnr_mean": 8.07, "floor_class_mean_psnr_mean": 12.32,
         "floor_random_psnr_mean": 11.46}  # fmt: skip
    assert "-4.2 dB (8.1 dB against floors of 12.3 dB, class mean, and 11.5 dB, random image)" in verdict(r)
    assert "against floors" not in verdict({**BASE, "psnr_mean_beyond_floor": -4.25})  # no floors: no text


def test_lines_come_by_round_then_node_and_skip_other_records():
    records = [
        {**BASE, "round": 2, "node_id": 9, "psnr_mean": 1.0},
        {"kind": "summary", "rounds": 2},
        {**BASE, "round": 1, "node_id": 9, "psnr_mean": 1.0},
        {**BASE, "round": 2, "node_id": 8, "psnr_mean": 1.0},
        {**BASE, "aggregated": True, "round": 3, "node_id": None, "psnr_mean": 1.0},
    ]
    lines = node_verdicts(records)
    assert [line.split(":")[0] for line in lines] == [
        "round 1, node 9",
        "round 2, node 8",
        "round 2, node 9",
        "round 3, the secure aggregate",
    ]


def test_every_client_that_sent_nothing_is_named_with_its_reason():
    records = [
        {
            "kind": "round",
            "round": 0,
            "errors": {"3": "defense 'aegis' failed in setup: cannot fill its cache"},
        },
        {"kind": "round", "round": 1, "errors": {}},
        {
            "kind": "client_error",
            "attack": "robbing_the_fed",
            "cell": 0,
            "client_id": 5,
            "error": "no update",
        },
        {"kind": "attack", "client_id": 6},
    ]
    assert withheld_lines(records) == [
        "round 0: client 3 sent no update: defense 'aegis' failed in setup: cannot fill its cache",
        "audit (robbing_the_fed): client 5 sent no update: no update",
    ]

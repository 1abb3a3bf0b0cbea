"""One verdict line per node and round of a deployment audit, with the rule that produced it.

A Flower audit (``AuditStrategy``, ``LegacyAuditStrategy``) leaves per reply an attack record, an attack
failure, or a rejection; the report turns each into one line an operator can act on. The rules, in order:

1. a rejected reply or a client error: nothing of that node was aggregated or attacked (the reason);
2. an attack that failed or refused the update: no verdict (its reason);
3. with the leakage above the null floor (the node's data and public images were given): **leaks** when it
   exceeds :data:`~gradleak.metrics.floors.LEAKS_ABOVE_DB` (the report's and the leakage gate's unit and
   threshold), else "no leakage above the floor *by this attack at this budget*" (one-sided: a stronger
   attack may still leak); text: ROUGE-1 against the same attack on a norm-matched random update, leaking
   unless paper 002's rule calls it blocked (at most max(0.05, null + 0.05));
4. with the node's data but no floor: the raw score, and that a floor needs public images;
5. without the node's data: only the attack's fit to the update; a failed attack shows its limit, not
   safety.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gradleak.attacks.text.baseline import is_blocked
from gradleak.metrics.floors import LEAKS_ABOVE_DB

KINDS = ("attack", "attack_error", "rejected", "client_error")


def _who(r: Mapping[str, Any]) -> str:
    node = r.get("node_id")
    where = "the secure aggregate" if r.get("aggregated") else f"node {node if node is not None else '?'}"
    return f"round {r.get('round', '?')}, {where}"


def _scores(r: Mapping[str, Any]) -> str:
    """The node's own mean PSNR beside its two floors, where the record holds them."""
    keys = ("psnr_mean", "floor_class_mean_psnr_mean", "floor_random_psnr_mean")
    values = [r.get(k) for k in keys]
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
        return ""
    psnr, mean_floor, random_floor = values
    return (f" ({psnr:.1f} dB against floors of {mean_floor:.1f} dB, class mean, and {random_floor:.1f} dB, "
            "random image)")  # fmt: skip


def _text_verdict(r: Mapping[str, Any], who: str, name: str) -> str | None:
    """Rules 3 and 4 for a text record (its ROUGE-1 against the null update's, paper 002's rule: leaks
    unless at most max(0.05, null + 0.05), :func:`~gradleak.attacks.text.baseline.is_blocked`); None for a
    record with no ROUGE-1."""
    r1, null = r.get("rouge1"), r.get("floor_null_rouge1")
    if not isinstance(r1, int | float):
        return None
    if not math.isfinite(r1):
        return f"{who}: {name} gave no finite score (rule 2), no verdict"
    if not isinstance(null, int | float) or not math.isfinite(null):
        return f"{who}: {name} reaches ROUGE-1 {r1:.3f} on the node's text; no null floor to compare (rule 4)"
    scores = f"ROUGE-1 {r1:.3f} against {null:.3f} from a norm-matched random update"
    if not is_blocked(float(r1), float(null)):
        return f"{who}: LEAKS to {name}: {scores} (rule 3: > max(0.05, null + 0.05), paper 002)"
    return (f"{who}: no leakage above the floor by {name} at this budget: {scores} (rule 3: <= max(0.05, "
            "null + 0.05); a stronger attack may still leak)")  # fmt: skip


def verdict(r: Mapping[str, Any]) -> str:
    """The line for one record (module docstring)."""
    who = _who(r)
    kind = r.get("kind")
    if kind in ("rejected", "client_error"):
        what = "rejected" if kind == "rejected" else "failed on the client"
        return f"{who}: reply {what} (rule 1): {r.get('error')}"
    name = str(r.get("attack", "?")) + (" (malicious server)" if r.get("malicious") else "")
    if kind == "attack_error":
        return f"{who}: {name} failed (rule 2), no verdict: {r.get('error')}"
    if r.get("refused"):
        return f"{who}: {name} refused the update (rule 2), no verdict: {r.get('refused')}"
    text = _text_verdict(r, who, name)
    if text is not None:
        return text
    over = r.get("psnr_mean_beyond_floor")
    if isinstance(over, int | float) and not math.isfinite(over):
        return f"{who}: {name} gave no finite score (rule 2), no verdict"
    if isinstance(over, int | float):
        scores = _scores(r)
        if over > LEAKS_ABOVE_DB:
            return (f"{who}: LEAKS to {name}: {over:+.1f} dB mean PSNR over the higher null floor{scores} "
                    f"(rule 3: > {LEAKS_ABOVE_DB:g} dB)")  # fmt: skip
        return (f"{who}: no leakage above the floor by {name} at this budget: {over:+.1f} dB{scores} "
                f"(rule 3: <= {LEAKS_ABOVE_DB:g} dB; a stronger attack may still leak)")  # fmt: skip
    psnr = r.get("psnr_mean")
    if isinstance(psnr, int | float):
        return (f"{who}: {name} reaches {psnr:.1f} dB mean PSNR on the node's data; no floor to compare "
                "(rule 4: give public images for the floors)")  # fmt: skip
    margin = r.get("fit_margin")
    if isinstance(margin, int | float):
        fit_text = f"it fits the update better than norm-matched noise by {margin:.3g} in matching loss"
    else:
        fit = r.get("matching_loss")
        fit_text = f"matching loss {fit:.3g}" if isinstance(fit, int | float) else "no fit reported"
    return (f"{who}: {name} ran without the node's data ({fit_text}; rule 5: the larger the margin, the more "
            "the update gives this attack; a small one shows the attack's limit, not safety)")  # fmt: skip


def node_verdicts(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The verdict lines of a deployment audit's records, by round and node."""
    chosen = [r for r in records if r.get("kind") in KINDS]
    chosen.sort(key=lambda r: (int(r.get("round") or 0), str(r.get("node_id")), str(r.get("attack", ""))))
    return [verdict(r) for r in chosen]


def withheld_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every client of a run that sent no update, and why: in a training round (its ``round`` record's
    ``errors``) or in the audit (``client_error`` records, per attack)."""
    lines = []
    for r in records:
        if r.get("kind") == "round":
            errors = r.get("errors") or {}
            lines += [
                f"round {r.get('round')}: client {c} sent no update: {why}" for c, why in errors.items()
            ]
        elif r.get("kind") == "client_error" and "client_id" in r:
            lines.append(
                f"audit ({r.get('attack', '?')}): client {r['client_id']} sent no update: {r.get('error')}"
            )
    return lines


__all__ = ["KINDS", "node_verdicts", "verdict", "withheld_lines"]

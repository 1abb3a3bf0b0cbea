"""AEGIS privacy (paper 002, Tables III/IV, V, VI and the privacy axis of Figures 3/4).

Per model x dataset x batch: the client computes one FedSGD gradient (eval mode) of B sequences (<= max
tokens) under each defense setting, and the server runs every analytical probe on it:

* Ch1 ``dager`` (attention-projection span, Table III/IV), Ch2 ``embedding_norm`` (embedding row norms),
  Ch3 ``mlp_svd`` (adaptive span check on the first MLP layer, Table V), ``lm_head_probe`` (row norms of an
  untied head, Table VI; only on models whose head is untied, e.g. ``gpt2_small_untied``).
* Defense settings (benchmarks/aegis_llm_common.py): ``none``; ``aegis_2ch`` (freeze + embedding flood, the
  paper's AEGIS-dagger); ``aegis`` (all three channels, defaults); ``aegis_rho_fc_0.3`` (the MLP retain
  ratio of the paper's Table V run); the baselines of Figures 3/4:
  ``dp_0.001/0.01/0.1`` (batch gradient clipped to norm 1, Gaussian noise of std sigma), ``prune_50/90/99``
  (magnitude pruning of the upload), ``soteria``. Baselines are attacked with DAGER only (the figures'
  privacy axis).
* The matched random-gradient null (norm-matched Gaussian noise in place of the undefended gradient) gives
  each probe's null R-1; a probe is *valid* when undefended R-1 > 0.10 and > null + 0.05 and *blocked* by a
  defense that brings it to <= max(0.05, null + 0.05) (paper 002, Sec. VI-C).
* A probe that refuses a defended gradient (DAGER finds the attention gradient exactly zero under AEGIS)
  scores R-1 = 0, and the refusal is recorded.

Scores: ROUGE-1/2/L and METEOR of the one-to-one matched sequences (DAGER) or of the recovered token set
(row-norm and MLP probes). Targets: AEGIS R-1 <= 0.05 where undefended DAGER >= 0.95 (paper: <= 0.005).

    python benchmarks/aegis_llm_privacy.py --scale smoke|small|paper [--models M ...] [--defenses D ...]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import is_blocked, is_valid, null_observation
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.text.client import fedsgd_text_update
from gradleak.text.data import encode, load_text_dataset, sample
from gradleak.text.metrics import decode, score_texts, score_token_set
from gradleak.text.models import TextModel, build_text_model
from gradleak.types import AttackInputError, Observation

from aegis_llm_common import AEGIS_SETTINGS, SETTINGS

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "aegis_llm_privacy"
TASK = {"gpt2_tiny": "causal_lm", "gpt2_small": "causal_lm", "gpt2_small_untied": "causal_lm",
        "smollm2": "causal_lm"}  # fmt: skip
DATA_KW: dict[str, dict[str, Any]] = {
    "rotten_tomatoes": {},
    "wikitext2": {"split": "test"},
    "financial_phrasebank": {},
}
PRIVACY_SETTINGS = ("none", "aegis_2ch", "aegis", "aegis_rho_fc_0.3", "dp_0.001", "dp_0.01", "dp_0.1",
                    "prune_50", "prune_90", "prune_99", "soteria")  # fmt: skip
TARGET_R1 = 0.05


@dataclass(frozen=True)
class Scale:
    models: tuple[str, ...]
    datasets: tuple[str, ...]
    batch_size: int
    max_tokens: int
    batches: int  # per cell and seed


def attack_options(name: str, tm: TextModel) -> dict[str, Any]:
    """On GPT-2, DAGER scans the embedding channel's token set (paper 002's combined recovery; the full
    vocabulary gives the same result at 50k/|set| times the L1 cost); on BERT it knows [SEP] ends sequences.
    SmolLM2 (tied head, trained) scans the full vocabulary: its embedding gradient's output-projection
    term hides the input rows, and its position-free L1 check needs a single scan anyway."""
    if name != "dager":
        return {}
    opts: dict[str, Any] = {}
    if tm.family == "gpt2":  # learned positions: one L1 scan per position; rotary models scan once
        opts["vocab"] = "embedding"
    if tm.family == "bert":
        opts["encoder"] = {"end_token_id": int(tm.tokenizer.sep_token_id)}  # the attacker knows the tokenizer
    return opts


def score(name: str, token_ids: list[list[int]], refs: list[list[int]], tm: TextModel) -> dict[str, Any]:
    if name == "dager":
        s = score_texts(decode(tm.tokenizer, token_ids), decode(tm.tokenizer, refs))
    else:
        s = score_token_set([t for seq in token_ids for t in seq], refs, tm.tokenizer)
    return s.as_dict()


SCALES = {
    "smoke": Scale(("gpt2_tiny", "bert_tiny"), ("rotten_tomatoes",), 2, 10, 1),
    "small": Scale(
        ("gpt2_small", "gpt2_small_untied", "smollm2", "minilm"),
        ("rotten_tomatoes", "wikitext2", "financial_phrasebank"),
        8,
        32,
        1,
    ),
    "paper": Scale(
        ("gpt2_small", "gpt2_small_untied", "smollm2", "minilm"),
        ("rotten_tomatoes", "wikitext2", "financial_phrasebank"),
        8,
        32,
        5,
    ),
}


def load_model(name: str, num_labels: int = 2) -> TextModel:
    """Classification heads get ``num_labels`` outputs (3 for Financial PhraseBank)."""
    task = TASK.get(name, "classification")
    kw = {"num_labels": num_labels} if task == "classification" else {}
    if name == "gpt2_small_untied":
        return build_text_model("gpt2_small", task, seed=0, tie_word_embeddings=False)
    return build_text_model(name, task, seed=0, **kw)


def untied(tm: TextModel) -> bool:
    emb, head = tm.model.get_input_embeddings(), tm.model.get_output_embeddings()
    return head is not None and head.weight is not emb.weight


def probes(tm: TextModel) -> list[str]:
    return ["dager", "embedding_norm", "mlp_svd"] + (["lm_head_probe"] if untied(tm) else [])


def run_probe(name: str, tm: TextModel, obs: Observation, refs: list[list[int]], seed: int) -> dict[str, Any]:
    attack = create_attack(name, **attack_options(name, tm))
    t0 = time.perf_counter()
    try:
        rec = attack.reconstruct(obs, generator=torch.Generator().manual_seed(seed))
    except AttackInputError as exc:
        zero = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0, "meteor": 0.0, "exact": 0.0}
        return {**zero, "refused": str(exc), "seconds": time.perf_counter() - t0}
    return {
        **score(name, rec.token_ids or [], refs, tm),
        "refused": None,
        "seconds": time.perf_counter() - t0,
    }


def run_cell(
    tm: TextModel, model_name: str, dataset: str, scale: Scale, seed: int, defenses: Sequence[str]
) -> list[dict[str, Any]]:
    task = TASK.get(model_name, "classification")
    data = load_text_dataset(dataset, **DATA_KW[dataset])
    rows = []
    for k in range(scale.batches):
        picked = sample(data, scale.batch_size, seed=seed * 1000 + k)
        labels = list(picked.labels) if picked.labels is not None else [0] * len(picked)
        batch = encode(list(picked.texts), tm.tokenizer, max_tokens=scale.max_tokens, labels=labels)
        refs = batch.sequences()
        shape = (batch.input_ids.shape[1],)
        plain = Observation(tm.model, fedsgd_text_update(tm.model, batch, task), shape, 2)
        nulls = {p: run_probe(p, tm, null_observation(plain, torch.Generator().manual_seed(seed)), refs, seed)
                 for p in probes(tm)}  # fmt: skip
        for setting in defenses:
            gen = torch.Generator().manual_seed(seed * 7919 + k)
            if setting == "none":
                obs = plain
            else:
                update = fedsgd_text_update(
                    tm.model, batch, task, defenses=SETTINGS[setting](tm), generator=gen
                )
                obs = Observation(tm.model, update, shape, 2)
            for p in probes(tm):
                if p == "dager" or setting in ("none", *AEGIS_SETTINGS):
                    r = run_probe(p, tm, obs, refs, seed)
                    row = {"model": model_name, "dataset": dataset, "defense": setting, "probe": p,
                           "seed": seed, "batch": k, "tokens": int(batch.attention_mask.sum()), **r,
                           "null_rouge1": nulls[p]["rouge1"]}  # fmt: skip
                    rows.append(row)
                    print(
                        f"  {model_name:17s} {dataset:20s} {setting:9s} {p:14s} R-1 {r['rouge1']:.3f} "
                        f"R-2 {r['rouge2']:.3f} M {r['meteor'] or 0:.3f} null {nulls[p]['rouge1']:.3f} "
                        f"{r['seconds']:.1f}s{' (refused)' if r['refused'] else ''}",
                        flush=True,
                    )
    return rows


MEAN_KEYS = ("rouge1", "rouge2", "rougeL", "meteor", "exact", "null_rouge1", "seconds")


def summarize_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["dataset"], r["defense"], r["probe"]), []).append(r)
    base = {(m, d, p): rs for (m, d, s, p), rs in cells.items() if s == "none"}
    out = []
    for (model, dataset, setting, probe), rs in cells.items():
        mean = {k: statistics.fmean(float(r[k] or 0.0) for r in rs) for k in MEAN_KEYS}
        undef = statistics.fmean(float(r["rouge1"]) for r in base.get((model, dataset, probe), rs))
        valid = is_valid(undef, mean["null_rouge1"])
        blocked = valid and setting != "none" and is_blocked(mean["rouge1"], mean["null_rouge1"])
        out.append({"model": model, "dataset": dataset, "defense": setting, "probe": probe, "n": len(rs),
                    **mean, "undefended_rouge1": undef, "valid": valid,
                    "blocked": blocked,
                    "refused": sum(r["refused"] is not None for r in rs)})  # fmt: skip
    return out


def make_payload(
    rows: list[dict[str, Any]], scale: Scale, defenses: list[str], threads: int, *, complete: bool
) -> dict[str, Any]:
    summary = summarize_rows(rows)
    aegis_dager = [c for c in summary if c["defense"] == "aegis" and c["probe"] == "dager"]
    strong = [c for c in aegis_dager if c["undefended_rouge1"] >= 0.95]
    payload = {
        "setting": {**asdict(scale), "defenses": defenses, "tasks": TASK, "protocol": "fedsgd, eval mode",
                    "dp": "batch gradient clipped to norm 1, N(0, sigma^2) per entry",
                    "null": "one norm-matched Gaussian null per model x dataset x batch x probe, undefended"},
        "complete": complete,
        "torch_threads": threads,
        "target_aegis_rouge1": TARGET_R1,
        "paper": {"aegis_rouge1_max": 0.005, "undefended_rouge1_decoders_min": 0.98,
                  "undefended_bert_min": 0.87, "table5_gpt2_small_ch3_2ch_3ch": [0.265, 0.265],
                  "table5_gpt2_xl_ch3_2ch_3ch": [0.292, 0.036], "fig3_prune_99_gpt2_rouge1_min": 0.39,
                  "fig3_prune_50_gpt2_rouge1": [0.55, 0.81]},
        "meets_target": bool(strong) and all(c["rouge1"] <= TARGET_R1 for c in strong),
        "summary": summary,
        "rows": rows,
    }  # fmt: skip
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--models", nargs="+", default=None, help="override the scale's models")
    parser.add_argument("--datasets", nargs="+", default=None, help="override the scale's datasets")
    parser.add_argument("--defenses", nargs="+", default=list(PRIVACY_SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--tag", default="", help="suffix of the result file name (partial runs)")
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    name = NAME
    if args.models or args.datasets:
        scale = Scale(tuple(args.models or scale.models), tuple(args.datasets or scale.datasets),
                      scale.batch_size, scale.max_tokens, scale.batches)  # fmt: skip
        name = f"{NAME}_{'_'.join(args.models or ['all'])}"  # a partial run never overwrites the full one
    name += f"_{args.tag}" if args.tag else ""
    defenses = ["none"] + [d for d in args.defenses if d != "none"]
    threads = configure_torch(args.threads)
    print(f"{NAME} --scale {args.scale}: {scale}, defenses {defenses}, seeds {args.seeds}", flush=True)
    rows: list[dict[str, Any]] = []
    for model_name in scale.models:
        for dataset in scale.datasets:
            tm = load_model(model_name, num_labels=3 if dataset == "financial_phrasebank" else 2)
            for seed in args.seeds:
                rows += run_cell(tm, model_name, dataset, scale, seed, defenses)
            # a checkpoint after every cell: an interrupted run keeps what it measured, labelled partial
            write_result(name, args.scale, make_payload(rows, scale, defenses, threads, complete=False),
                         seeds=args.seeds, out=args.out)  # fmt: skip
            del tm
    payload = make_payload(rows, scale, defenses, threads, complete=True)
    summary = payload["summary"]
    path = write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)
    cols = "model | dataset | defense | probe | R-1 | R-2 | R-L | METEOR | undef R-1 | null | valid | blocked"
    print(f"| {cols} |")
    for c in summary:
        print(
            f"| {c['model']} | {c['dataset']} | {c['defense']} | {c['probe']} | {c['rouge1']:.3f} | "
            f"{c['rouge2']:.3f} | {c['rougeL']:.3f} | {c['meteor']:.3f} | {c['undefended_rouge1']:.3f} | "
            f"{c['null_rouge1']:.3f} | {c['valid']} | {c['blocked']} |"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

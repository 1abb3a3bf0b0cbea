"""Undefended analytical text attacks (paper 002, Tables III-VI; DAGER, Petrov et al. 2024).

Setting: GPT-2 architecture (124M from config, random init, real tokenizer; causal LM), SmolLM2-135M (Llama,
real weights; causal LM) and all-MiniLM-L6-v2 (BERT, real weights; sequence classification, 2 labels)
x Rotten Tomatoes and WikiText-2 (test). Per cell and batch: B = 8 sequences drawn with a seeded sampler,
truncated to <= 32 tokens; the client sends one FedSGD gradient at the broadcast weights (eval mode); the
server runs ``dager`` (``vocab="embedding"``: the L1 scan covers the embedding channel's token set, paper
002's combined recovery), ``embedding_norm`` and ``mlp_svd``, each also on a matched random-gradient null
observation (paper 002 Sec. VI-C). WikiText-2 has no labels: the classifier trains on label 0.

Scores: ROUGE-1/2/L and METEOR of the one-to-one matched reconstructions (DAGER: sequences; side
channels: the recovered token set against the batch's concatenated references), exact-sequence rate, and
the attack time as a ratio to the median of 3 forward+backward passes of the same model on the same batch.
Target: DAGER R-1 >= 0.95 (paper: >= 0.98 on decoders, >= 0.87 on BERT).

    python benchmarks/text_attacks.py --scale smoke|small|paper [--seed S ...] [--threads T] [--models M ...]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.baseline import is_valid, null_observation
from gradleak.text.client import fedsgd_text_update
from gradleak.text.data import encode, load_text_dataset, sample
from gradleak.text.metrics import decode, score_texts, score_token_set
from gradleak.text.models import TextModel, build_text_model
from gradleak.types import Observation

from _common import configure_torch, make_parser, parse_args, write_result

NAME = "text_attacks"
TARGET_R1 = 0.95
ATTACKS = ("dager", "embedding_norm", "mlp_svd")
TASK = {"gpt2_tiny": "causal_lm", "gpt2_small": "causal_lm", "smollm2": "causal_lm"}
DATA_KW: dict[str, dict[str, Any]] = {"rotten_tomatoes": {}, "wikitext2": {"split": "test"}}


@dataclass(frozen=True)
class Scale:
    models: tuple[str, ...]
    datasets: tuple[str, ...]
    batch_size: int
    max_tokens: int
    batches: int  # per cell and seed


SCALES = {
    "smoke": Scale(("gpt2_tiny", "bert_tiny"), ("rotten_tomatoes",), 2, 10, 1),
    "small": Scale(("gpt2_small", "smollm2", "minilm"), ("rotten_tomatoes", "wikitext2"), 8, 32, 1),
    "paper": Scale(("gpt2_small", "smollm2", "minilm"), ("rotten_tomatoes", "wikitext2"), 8, 32, 5),
}


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


def fwd_bwd_seconds(tm: TextModel, batch: Any, task: str, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fedsgd_text_update(tm.model, batch, task)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def score(name: str, token_ids: list[list[int]], refs: list[list[int]], tm: TextModel) -> dict[str, Any]:
    if name == "dager":
        s = score_texts(decode(tm.tokenizer, token_ids), decode(tm.tokenizer, refs))
    else:
        s = score_token_set([t for seq in token_ids for t in seq], refs, tm.tokenizer)
    return s.as_dict()


def run_cell(tm: TextModel, dataset: str, scale: Scale, seed: int) -> list[dict[str, Any]]:
    task = TASK.get(tm.name, "classification")
    data = load_text_dataset(dataset, **DATA_KW[dataset])
    rows = []
    for k in range(scale.batches):
        picked = sample(data, scale.batch_size, seed=seed * 1000 + k)
        labels = list(picked.labels) if picked.labels is not None else [0] * len(picked)
        batch = encode(list(picked.texts), tm.tokenizer, max_tokens=scale.max_tokens, labels=labels)
        refs = batch.sequences()
        base = fwd_bwd_seconds(tm, batch, task)
        update = fedsgd_text_update(tm.model, batch, task)
        obs = Observation(tm.model, update, (batch.input_ids.shape[1],), 2)
        null_obs = null_observation(obs, torch.Generator().manual_seed(seed))
        for name in ATTACKS:
            attack = create_attack(name, **attack_options(name, tm))
            t0 = time.perf_counter()
            rec = attack.reconstruct(obs, generator=torch.Generator().manual_seed(seed))
            seconds = time.perf_counter() - t0
            null_rec = attack.reconstruct(null_obs, generator=torch.Generator().manual_seed(seed))
            s, ns = (
                score(name, rec.token_ids or [], refs, tm),
                score(name, null_rec.token_ids or [], refs, tm),
            )
            row = {
                "model": tm.name, "dataset": dataset, "attack": name, "seed": seed, "batch": k,
                "tokens": int(batch.attention_mask.sum()), **s, "null_rouge1": ns["rouge1"],
                "valid": is_valid(s["rouge1"], ns["rouge1"]), "seconds": seconds, "fwd_bwd_seconds": base,
                "time_ratio": seconds / base, "stats": rec.stats,
            }  # fmt: skip
            rows.append(row)
            print(
                f"  {tm.name:10s} {dataset:15s} {name:14s} R-1 {s['rouge1']:.3f} R-2 {s['rouge2']:.3f} "
                f"R-L {s['rougeL']:.3f} M {s['meteor']:.3f} exact {s['exact']:.2f} null {ns['rouge1']:.3f} "
                f"{seconds:.1f}s ({seconds / base:.0f}x fwd+bwd)",
                flush=True,
            )
    return rows


MEAN_KEYS = ("rouge1", "rouge2", "rougeL", "meteor", "exact", "null_rouge1", "seconds", "time_ratio")


def summarize_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["model"], r["dataset"], r["attack"]), []).append(r)
    out = []
    for (model, dataset, attack), rs in cells.items():
        mean = {k: statistics.fmean(float(r[k]) for r in rs) for k in MEAN_KEYS}
        out.append({"model": model, "dataset": dataset, "attack": attack, "n": len(rs), **mean,
                    "valid": is_valid(mean["rouge1"], mean["null_rouge1"])})  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, help="override the scale's models")
    parser.add_argument("--datasets", nargs="+", default=None, choices=list(DATA_KW), help="subset")
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    name = NAME
    if args.models:
        scale = Scale(tuple(args.models), scale.datasets, scale.batch_size, scale.max_tokens, scale.batches)
        name = f"{NAME}_{'_'.join(args.models)}"  # a partial run never overwrites the full result
    if args.datasets:
        scale = Scale(scale.models, tuple(args.datasets), scale.batch_size, scale.max_tokens, scale.batches)
        name = f"{name}_{'_'.join(args.datasets)}"
    threads = configure_torch(args.threads)
    print(f"{NAME} --scale {args.scale}: {scale}, seeds {args.seeds}, torch threads {threads}", flush=True)
    rows: list[dict[str, Any]] = []
    load_seconds = {}
    for model_name in scale.models:
        t0 = time.perf_counter()
        tm = build_text_model(model_name, TASK.get(model_name, "classification"), seed=0)
        load_seconds[model_name] = time.perf_counter() - t0
        for dataset in scale.datasets:
            for seed in args.seeds:
                rows += run_cell(tm, dataset, scale, seed)
        del tm
    summary = summarize_rows(rows)
    dager = [c["rouge1"] for c in summary if c["attack"] == "dager"]
    payload = {
        "setting": {
            **asdict(scale),
            "attacks": list(ATTACKS),
            "tasks": TASK,
            "protocol": "fedsgd, eval mode",
        },
        "torch_threads": threads,
        "target_dager_rouge1": TARGET_R1,
        "meets_target": bool(dager) and min(dager) >= TARGET_R1,
        "model_load_seconds": load_seconds,
        "summary": summary,
        "rows": rows,
    }
    path = write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)
    print(
        "| model | dataset | attack | R-1 | R-2 | R-L | METEOR | exact | null R-1 | valid | s | x fwd+bwd |"
    )
    for c in summary:
        print(
            f"| {c['model']} | {c['dataset']} | {c['attack']} | {c['rouge1']:.3f} | {c['rouge2']:.3f} | "
            f"{c['rougeL']:.3f} | {c['meteor']:.3f} | {c['exact']:.2f} | {c['null_rouge1']:.3f} | "
            f"{c['valid']} | {c['seconds']:.1f} | {c['time_ratio']:.0f} |"
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

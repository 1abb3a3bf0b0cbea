"""AEGIS utility (paper 002, Table II ablation and the utility axis of Figures 3/4) on pretrained models.

One client fine-tunes a pretrained model by FedSGD rounds: each step it computes the defended gradient of
one batch (B sequences, <= max tokens, eval mode) with :func:`gradleak.text.client.fedsgd_text_update`, and
the server applies it with AdamW (lr 5e-5 as in the paper, weight decay 0, so the zero slots of frozen
attention leave those weights unchanged). Under AEGIS this is exactly the client's own optimiser stepping on
the masked gradient. Same seeded batch order for every setting.

* SmolLM2-135M (real weights, causal LM): fine-tune on WikiText-2 *valid* (the train split is not available
  here), report test perplexity on WikiText-2 *test*.
* all-MiniLM-L6-v2 (real weights, sequence classification with a seeded new head): fine-tune on a seeded 80 %
  split of Rotten Tomatoes, report accuracy and macro-F1 on the held-out 20 %.

Settings (benchmarks/aegis_llm_common.py): none, freeze, embed, aegis_2ch, aegis, aegis_rho_fc_0.3 (Table II)
and the baselines dp_0.001/0.01/0.1, prune_50/90/99, soteria (Figures 3/4). Target: AEGIS perplexity <= 1.02 x
undefended after the same steps. Paper (GPT-2 small, WikiText-2, thousands of steps): PPL 26.0 undefended ->
25.6 AEGIS; AEGIS-2ch 25.7.

    python benchmarks/aegis_llm_utility.py --scale smoke|small|paper [--models M ...] [--settings S ...]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.text.client import fedsgd_text_update
from gradleak.text.data import TextBatch, TextDataset, load_text_dataset, sample, split
from gradleak.text.metrics import accuracy, classify, macro_f1, perplexity
from gradleak.text.models import TextModel, build_text_model

from aegis_llm_common import SETTINGS, encode_batches

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "aegis_llm_utility"
UTILITY_SETTINGS = ("none", "freeze", "embed", "aegis_2ch", "aegis", "aegis_rho_fc_0.3", "dp_0.001",
                    "dp_0.01", "dp_0.1", "prune_50", "prune_90", "prune_99", "soteria")  # fmt: skip
TARGET_PPL_RATIO = 1.02
LR = 5e-5


@dataclass(frozen=True)
class Task:
    model: str
    task: str  # causal_lm | classification
    dataset: str
    steps: int
    eval_examples: int
    max_tokens: int
    batch_size: int = 8


@dataclass(frozen=True)
class Scale:
    tasks: tuple[Task, ...]


# small: SmolLM2 costs ~10-20 s per fwd+bwd of 8 x 64 tokens on one loaded core, hence 32 tokens, 20 steps
SCALES = {
    "smoke": Scale((Task("gpt2_tiny", "causal_lm", "wikitext2", 3, 16, 32, 4),
                    Task("bert_tiny", "classification", "rotten_tomatoes", 3, 32, 32, 4))),
    "small": Scale((Task("smollm2", "causal_lm", "wikitext2", 20, 64, 32),
                    Task("minilm", "classification", "rotten_tomatoes", 100, 600, 32))),
    "paper": Scale((Task("smollm2", "causal_lm", "wikitext2", 300, 512, 64),
                    Task("minilm", "classification", "rotten_tomatoes", 1500, 2132, 64))),
}  # fmt: skip


def datasets(task: Task, seed: int) -> tuple[TextDataset, TextDataset]:
    if task.dataset == "wikitext2":
        return load_text_dataset("wikitext2", split="valid"), load_text_dataset("wikitext2", split="test")
    train, test = split(load_text_dataset(task.dataset), [0.8, 0.2], seed=seed)
    return train, test


def batches(data: TextDataset, n_examples: int, tm: TextModel, task: Task, seed: int) -> list[TextBatch]:
    picked = sample(data, min(n_examples, len(data)), seed=seed)
    return encode_batches(picked, task.batch_size, tm, task.max_tokens)


@torch.no_grad()
def evaluate(tm: TextModel, task: Task, test: list[TextBatch]) -> dict[str, float]:
    if task.task == "causal_lm":
        return {"perplexity": perplexity(tm.model, test)}
    pred, true = classify(tm.model, test)
    return {"accuracy": accuracy(pred, true), "f1": macro_f1(pred, true)}


def finetune(tm: TextModel, task: Task, setting: str, train: list[TextBatch], seed: int) -> dict[str, Any]:
    """FedSGD rounds of one client; the model is changed in place."""
    opt = torch.optim.AdamW(tm.model.parameters(), lr=LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for batch in tqdm(train, desc=f"{task.model} {setting}", leave=False):
        update = fedsgd_text_update(tm.model, batch, task.task, defenses=SETTINGS[setting](tm), generator=gen)
        opt.zero_grad(set_to_none=True)
        for name, p in tm.model.named_parameters():
            p.grad = update.tensors[name].to(p.dtype)
        opt.step()
    return {"train_seconds": time.perf_counter() - t0}


def run_task(task: Task, settings: Sequence[str], seed: int) -> list[dict[str, Any]]:
    train_data, test_data = datasets(task, seed)
    tm = build_text_model(task.model, task.task, seed=0)
    state = {k: v.clone() for k, v in tm.model.state_dict().items()}
    train = batches(train_data, task.steps * task.batch_size, tm, task, seed)[: task.steps]
    test = batches(test_data, task.eval_examples, tm, task, seed + 1)
    rows = [{"model": task.model, "dataset": task.dataset, "setting": "pretrained", "seed": seed, "steps": 0,
             **evaluate(tm, task, test)}]  # fmt: skip
    print(f"  {task.model} {task.dataset} pretrained {rows[0]}", flush=True)
    for setting in settings:
        tm.model.load_state_dict(state)
        info = finetune(tm, task, setting, train, seed)
        row = {"model": task.model, "dataset": task.dataset, "setting": setting, "seed": seed,
               "steps": len(train), **evaluate(tm, task, test), **info}  # fmt: skip
        rows.append(row)
        print(f"  {task.model} {task.dataset} {setting:17s} {row}", flush=True)
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    base = {(r["model"], r["seed"]): r for r in rows if r["setting"] == "none"}
    out = []
    for r in rows:
        b = base.get((r["model"], r["seed"]))
        s = {"model": r["model"], "setting": r["setting"], "seed": r["seed"]}
        if "perplexity" in r:
            s["perplexity"] = r["perplexity"]
            s["ppl_ratio_vs_none"] = r["perplexity"] / b["perplexity"] if b else None
        else:
            s.update(accuracy=r["accuracy"], f1=r["f1"])
            s["accuracy_minus_none"] = r["accuracy"] - b["accuracy"] if b else None
        out.append(s)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--models", nargs="+", default=None, help="run only these models' tasks")
    parser.add_argument("--settings", nargs="+", default=list(UTILITY_SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=None, help="override the fine-tuning steps (own file)")
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    tasks = [t for t in scale.tasks if not args.models or t.model in args.models]
    name = NAME if not args.models else f"{NAME}_{'_'.join(args.models)}"
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        tasks = [dataclasses.replace(t, steps=args.steps) for t in tasks]
        name += f"_steps{args.steps}"
    settings = ["none"] + [s for s in args.settings if s != "none"]
    threads = configure_torch(args.threads)
    print(f"{NAME} --scale {args.scale}: {tasks}, settings {settings}, seeds {args.seeds}", flush=True)
    rows: list[dict[str, Any]] = []
    for task in tasks:
        for seed in args.seeds:
            rows += run_task(task, settings, seed)
    summary = summarize(rows)
    aegis_ppl = [s["ppl_ratio_vs_none"] for s in summary if s["setting"] == "aegis" and "perplexity" in s]
    payload = {
        "setting": {**asdict(scale), "settings": settings, "lr": LR, "optimizer": "AdamW (server), wd 0",
                    "protocol": "FedSGD rounds of one client, eval mode, seeded batch order"},
        "torch_threads": threads,
        "target_ppl_ratio": TARGET_PPL_RATIO,
        "meets_target": bool(aegis_ppl) and max(aegis_ppl) <= TARGET_PPL_RATIO,
        "paper": {"gpt2_wikitext2_ppl_none_aegis": [26.0, 25.6], "gpt2_wikitext2_ppl_2ch_3ch": [25.7, 25.7],
                  "gpt2_xl_wikitext2_ppl_none_aegis": [25.7, 22.1]},
        "summary": summary,
        "rows": rows,
    }  # fmt: skip
    path = write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)
    print("| model | setting | perplexity (x none) | accuracy (- none) | F1 |")
    for s in summary:
        if "perplexity" in s:
            ratio = s["ppl_ratio_vs_none"]
            print(f"| {s['model']} | {s['setting']} | {s['perplexity']:.2f} ({ratio or 0:.3f}x) | | |")
        else:
            acc = f"{s['accuracy']:.3f} ({s['accuracy_minus_none'] or 0:+.3f})"
            print(f"| {s['model']} | {s['setting']} | | {acc} | {s['f1']:.3f} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

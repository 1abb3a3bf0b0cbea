"""AEGIS utility over a long fine-tuning horizon with paper 002's training protocol (Sec. VI-A).

The short-horizon utility benchmark (configs/aegis_llm_utility.toml) measures AEGIS after a fixed 20-1067
steps. Paper 002 fine-tunes for up to 8 epochs or 12,000 steps with early stopping, and its utility claim
(test perplexity at or below the undefended baseline) is made there.
This script follows that protocol on one client:

* the client's own loop (:class:`gradleak.tasks.text_client.LocalTrainer`): AEGIS ``setup`` freezes attention
  before the optimiser is built, every step floods the gradient and AdamW steps on it (paper 002,
  Algorithm 1);
* AdamW lr 5e-5, weight decay 0.01, linear warm-up over the first 10 % of the planned steps then linear decay,
  batch 8, dropout on (train mode), as the paper's transformers training;
* evaluation on a validation split every ``eval_every`` steps; early stopping on validation loss with
  patience 5; the test metric is taken at the best validation loss.

Tasks: MiniLM (real weights, new 2-class head) on Rotten Tomatoes, 80 % train, the other 20 % halved into
validation and test (seeded); SmolLM2-135M (``paper`` scale only: ~11 s per step here) on WikiText-2 valid
(90 % train / 10 % validation), test perplexity on WikiText-2 test. Each run writes the validation curve, so
the gap between the settings can be read at every evaluation.

    python benchmarks/aegis_llm_horizon.py --scale smoke|small|paper --settings none aegis_llm \
        [--models minilm]

Run one setting per process to use both cores, then merge them (no training) with
``--combine FILE FILE`` (or pass ``--reference`` the undefended result file to a defended run).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gradleak.data.text import TextBatch, TextDataset, encode, load_text_dataset, split
from gradleak.defenses.in_loop import build_defenses
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.metrics.utility import accuracy, macro_f1, perplexity
from gradleak.models.text import TextModel, build_text_model
from gradleak.registry import DEFENSES, PRESETS
from gradleak.tasks.text_client import LocalTrainer

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
# the text defenses at their defaults and the presets (Soteria needs the model's layers: not offered here)
SETTINGS = sorted(
    {*(e.name for e in DEFENSES if e.modality != "image" and e.name != "soteria"), *PRESETS.names()}
)


def encode_batches(data: TextDataset, size: int, tm: TextModel, max_tokens: int) -> list[TextBatch]:
    """``data`` in order, cut into consecutive batches of ``size`` sequences (labels kept when present)."""
    out = []
    for i in range(0, len(data), size):
        part = data.subset(range(i, min(i + size, len(data))))
        labels = list(part.labels) if part.labels is not None else None
        out.append(encode(list(part.texts), tm.tokenizer, max_tokens=max_tokens, labels=labels))
    return out


NAME = "aegis_llm_horizon"
LR, WEIGHT_DECAY, WARMUP_FRACTION, PATIENCE = 5e-5, 0.01, 0.1, 5
TARGET_PPL_RATIO = 1.02


@dataclass(frozen=True)
class Task:
    model: str
    task: str  # causal_lm | classification
    dataset: str
    max_tokens: int
    max_epochs: int
    max_steps: int
    eval_every: int
    eval_batch: int = 32
    batch_size: int = 8
    train_limit: int | None = None  # examples (smoke)
    eval_limit: int | None = None  # validation and test examples (smoke)


SCALES = {
    "smoke": (Task("bert_tiny", "classification", "rotten_tomatoes", 32, 2, 40, 10, train_limit=80),
              Task("gpt2_tiny", "causal_lm", "wikitext2", 32, 1, 10, 5, train_limit=80, eval_limit=256)),
    "small": (Task("minilm", "classification", "rotten_tomatoes", 32, 8, 12000, 200),),
    "paper": (Task("minilm", "classification", "rotten_tomatoes", 64, 8, 12000, 200),
              Task("smollm2", "causal_lm", "wikitext2", 64, 8, 2000, 200)),
}  # fmt: skip


def splits(task: Task, seed: int) -> tuple[TextDataset, TextDataset, TextDataset]:
    """(train, validation, test) for the task, seeded."""
    if task.dataset == "wikitext2":
        train, val = split(load_text_dataset("wikitext2", split="valid"), [0.9, 0.1], seed=seed)
        return train, val, load_text_dataset("wikitext2", split="test")
    train, held = split(load_text_dataset(task.dataset), [0.8, 0.2], seed=seed)
    val, test = split(held, [0.5, 0.5], seed=seed + 1)
    return train, val, test


@torch.no_grad()
def evaluate(tm: TextModel, task: Task, data: list[TextBatch]) -> dict[str, float]:
    """Mean loss per next token (causal LM: log of the perplexity) or per example (classification, one
    forward pass for loss and predictions) and the task metric."""
    tm.model.eval()
    if task.task == "causal_lm":
        ppl = perplexity(tm.model, data)
        return {"loss": math.log(ppl), "perplexity": ppl}
    loss, pred, true = 0.0, [], []
    for b in data:
        out = tm.model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels)
        loss += float(out.loss) * len(b)
        pred += out.logits.argmax(-1).tolist()
        true += b.labels.tolist() if b.labels is not None else []
    return {"loss": loss / len(pred), "accuracy": accuracy(pred, true), "f1": macro_f1(pred, true)}


def train_order(n_batches: int, epochs: int, seed: int) -> list[int]:
    """A fresh seeded shuffle of the batch indices for every epoch."""
    gen = torch.Generator().manual_seed(seed)
    return [i for _ in range(epochs) for i in torch.randperm(n_batches, generator=gen).tolist()]


def run(task: Task, setting: str, seed: int, device: str = "cpu") -> dict[str, Any]:
    train_data, val_data, test_data = splits(task, seed)
    if task.train_limit:
        train_data = train_data.subset(range(min(task.train_limit, len(train_data))))
    if task.eval_limit:
        val_data, test_data = (d.subset(range(min(task.eval_limit, len(d)))) for d in (val_data, test_data))
    tm = build_text_model(task.model, task.task, seed=0)
    tm.model.to(device)
    train = [b.to(device) for b in encode_batches(train_data, task.batch_size, tm, task.max_tokens)]
    val = [b.to(device) for b in encode_batches(val_data, task.eval_batch, tm, task.max_tokens)]
    test = [b.to(device) for b in encode_batches(test_data, task.eval_batch, tm, task.max_tokens)]
    total = min(task.max_epochs * len(train), task.max_steps)
    order = train_order(len(train), task.max_epochs, seed)[:total]
    torch.manual_seed(seed)  # dropout masks
    trainer = LocalTrainer(
        tm.model, task.task, lr=LR, optimizer="adamw", weight_decay=WEIGHT_DECAY,
        warmup_steps=max(1, int(WARMUP_FRACTION * total)), total_steps=total, dropout=True,
        defenses=build_defenses([setting]), generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    curve = [{"step": 0, **evaluate(tm, task, val)}]
    best, best_state, bad = curve[0]["loss"], copy.deepcopy(tm.model.state_dict()), 0
    losses: list[float] = []
    t0 = time.perf_counter()
    for i, b in enumerate(tqdm(order, desc=f"{task.model} {setting}", mininterval=30)):
        losses.append(trainer.step(train[b]))
        if (i + 1) % task.eval_every and i + 1 != total:
            continue
        point = {"step": i + 1, "train_loss": sum(losses) / len(losses), **evaluate(tm, task, val)}
        losses = []
        curve.append(point)
        print(f"  {task.model} {setting} {point}", flush=True)
        if point["loss"] < best:
            best, best_state, bad = point["loss"], copy.deepcopy(tm.model.state_dict()), 0
        else:
            bad += 1
            if bad >= PATIENCE:
                break
    seconds = time.perf_counter() - t0
    best_step = min(curve, key=lambda p: p["loss"])["step"]
    tm.model.load_state_dict(best_state)
    return {"model": task.model, "dataset": task.dataset, "setting": setting, "seed": seed,
            "planned_steps": total, "steps_run": trainer.steps_done, "best_step": best_step,
            "train_seconds": seconds, "seconds_per_step": seconds / max(trainer.steps_done, 1),
            "test_at_best": evaluate(tm, task, test), "curve": curve}  # fmt: skip


def compare(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The defended run against the undefended one: test metric at best, and the curves step by step."""
    out: dict[str, Any] = {"setting": row["setting"], "reference": ref["setting"]}
    mine, theirs = row["test_at_best"], ref["test_at_best"]
    if "perplexity" in mine:
        out["ppl_ratio"] = mine["perplexity"] / theirs["perplexity"]
        out["meets_target"] = out["ppl_ratio"] <= TARGET_PPL_RATIO
        key = "perplexity"
    else:
        out["accuracy_minus_reference"] = mine["accuracy"] - theirs["accuracy"]
        key = "accuracy"
    by_step = {p["step"]: p[key] for p in ref["curve"]}
    out[f"val_{key}_gap_by_step"] = {p["step"]: p[key] - by_step[p["step"]] for p in row["curve"]
                                     if p["step"] in by_step}  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--models", nargs="+", default=None, help="run only these models' tasks")
    parser.add_argument("--settings", nargs="+", default=["none", "aegis_llm"], choices=SETTINGS)
    parser.add_argument(
        "--reference", type=Path, default=None, help="a result file of this script with the undefended run"
    )
    parser.add_argument("--device", default="cpu", help="torch device for the model and batches (cpu, cuda)")
    parser.add_argument("--combine", type=Path, nargs="+", default=None,
                        help="no training: merge the runs of these result files (one setting per process) "
                             "into one file with the comparisons")  # fmt: skip
    args = parse_args(parser, argv)
    tasks = [t for t in SCALES[args.scale] if not args.models or t.model in args.models]
    if not tasks:
        parser.error(f"no task of scale {args.scale} for models {args.models}")
    refs: list[dict[str, Any]] = []
    if args.reference is not None:
        refs = [r for r in json.loads(args.reference.read_text())["result"]["rows"] if r["setting"] == "none"]
        if not refs:
            parser.error(f"{args.reference} holds no undefended ('none') run")
    threads = configure_torch(args.threads)
    if args.combine:
        rows = [r for f in args.combine for r in json.loads(f.read_text())["result"]["rows"]]
        rows = [r for r in rows if r["model"] in {t.model for t in tasks} and r["seed"] in args.seeds]
        if not rows:
            parser.error(f"no run of {[t.model for t in tasks]}, seeds {args.seeds} in {args.combine}")
        args.settings = list(dict.fromkeys(r["setting"] for r in rows))
    else:
        print(
            f"{NAME} --scale {args.scale}: {tasks}, settings {args.settings}, seeds {args.seeds}", flush=True
        )
        rows = [run(t, s, seed, args.device) for t in tasks for seed in args.seeds for s in args.settings]
    refs += [r for r in rows if r["setting"] == "none"]
    comparisons = []
    for r in rows:
        ref = next((x for x in refs if (x["model"], x["seed"]) == (r["model"], r["seed"])), None)
        if ref is not None and r["setting"] != "none":
            comparisons.append({"model": r["model"], "seed": r["seed"], **compare(r, ref)})
    name = f"{NAME}_{'_'.join(args.models or [t.model for t in tasks])}_{'_'.join(args.settings)}"
    payload = {
        "protocol": {"tasks": [asdict(t) for t in tasks], "lr": LR, "weight_decay": WEIGHT_DECAY,
                     "warmup_fraction": WARMUP_FRACTION, "schedule": "linear warm-up, linear decay to 0",
                     "patience": PATIENCE, "optimizer": "AdamW (the client's own, on the defended gradient)",
                     "dropout": True},
        "torch_threads": threads,
        "device": args.device,
        "reference": str(args.reference) if args.reference else None,
        "combined_from": [str(f) for f in args.combine] if args.combine else None,
        "paper": {"protocol": "AdamW 5e-5, wd 0.01, 10 % warm-up, <= 8 epochs / 12,000 steps (2,000-step "
                              "cap), early stopping on validation loss (patience 5, every 200 steps)",
                  "gpt2_wikitext2_ppl_none_aegis": [26.0, 25.6]},
        "comparisons": comparisons,
        "rows": rows,
    }  # fmt: skip
    path = write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)
    for r in rows:
        print(f"{r['model']} {r['setting']}: best step {r['best_step']} of {r['steps_run']}, "
              f"test {r['test_at_best']}")  # fmt: skip
    for c in comparisons:
        print(c)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

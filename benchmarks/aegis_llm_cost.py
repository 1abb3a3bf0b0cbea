"""AEGIS cost (paper 002, Table VIII): step time, peak memory and payload, undefended vs AEGIS vs baselines.

One full local training step = forward + backward + defense + AdamW step on a fixed batch (B sequences of
``tokens`` tokens), per model (GPT-2 arch 124M from config, SmolLM2-135M, all-MiniLM-L6-v2) and setting
(none, aegis_llm, and the presets dp_0.01 and prune_90 of ``gradleak list``). Each setting trains its own
copy of the model, set up once (AEGIS freezes attention before the optimiser is built, so AdamW holds no
state for it).

* Step time: the settings' steps are interleaved round by round (order rotated every round) after warm-up
  rounds, so machine noise hits all settings alike; we report each setting's median and the median of the
  per-round ratios to ``none``. Pruning runs its ``on_update`` on the step's gradient (the upload of a FedSGD
  round).
* Peak memory: for each setting in its own spawned process, Linux's peak-RSS counter (VmHWM, reset
  through /proc/self/clear_refs) over ``memory_steps`` steps, minus the RSS before them: the training
  working set (gradients, optimiser state, activations, defense temporaries), not the weights.
* Payload: bytes of the dense update a client must send: every tensor that can change (frozen attention
  slots are identically zero and need not be sent), and the full state for reference.

Targets: AEGIS step time <= 1.10 x undefended; peak memory <= undefended. Paper (H100, seq 64, GPT-2 /
GPT-2-XL / LLaMA-2-7B): 1.10 / 1.12 / 1.22 x; peak memory 2.24 -> 2.01 GiB (GPT-2); dense payload 0.464 ->
0.358 GiB (GPT-2).

    python benchmarks/aegis_llm_cost.py --scale smoke|small|paper [--models M ...]
"""

from __future__ import annotations

import copy
import gc
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gradleak.data.text import TextBatch, encode, load_text_dataset, sample
from gradleak.defenses import DefenseChain
from gradleak.defenses.base import SetupContext
from gradleak.defenses.in_loop import build_defenses
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.models.text import TextModel, build_text_model
from gradleak.tasks import text_loss
from gradleak.types import Update

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
NAME = "aegis_llm_cost"
COST_SETTINGS = ("none", "aegis_llm", "dp_0.01", "prune_90")  # defenses or presets (gradleak list)
TASK = {"gpt2_tiny": "causal_lm", "gpt2_small": "causal_lm", "smollm2": "causal_lm"}
TARGET_TIME_RATIO = 1.10
GIB = 2**30


@dataclass(frozen=True)
class Scale:
    models: tuple[str, ...]
    batch_size: int
    tokens: int
    warmup: int
    rounds: int
    memory_steps: int


SCALES = {
    "smoke": Scale(("gpt2_tiny", "bert_tiny"), 4, 16, 1, 3, 2),
    "small": Scale(("gpt2_small", "smollm2", "minilm"), 8, 64, 2, 8, 2),
    "paper": Scale(("gpt2_small", "smollm2", "minilm"), 8, 64, 20, 100, 3),
}


class Trainer:
    """One setting's model copy, defense chain and AdamW optimiser."""

    def __init__(self, tm: TextModel, setting: str, seed: int, *, private_copy: bool = True) -> None:
        self.model = copy.deepcopy(tm.model) if private_copy else tm.model
        self.chain = DefenseChain(build_defenses([setting]))
        self.chain.setup(self.model, SetupContext(torch.Generator().manual_seed(seed)))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=5e-5, weight_decay=0.0)
        self.task = TASK.get(tm.name, "classification")
        self.model.train(False)

    def step(self, batch: TextBatch, step: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        text_loss(self.model, batch, self.task).backward()
        self.chain.on_gradients(self.model, step)
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        if any(d.name == "pruning" for d in self.chain.defenses):
            self.chain.on_update(Update(grads, len(batch), kind="gradient"))
        self.opt.step()

    def payload_bytes(self) -> tuple[int, int]:
        full = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return sum(p.numel() * p.element_size() for p in self.params), full


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _memory_probe(model_name: str, setting: str, scale: Scale, seed: int, threads: int) -> int | None:
    """In a fresh process: peak RSS increase over ``memory_steps`` steps (None without Linux's counter)."""
    torch.set_num_threads(threads)
    tm = build_text_model(model_name, TASK.get(model_name, "classification"), seed=0)
    batch = fixed_batch(tm, scale, seed)
    trainer = Trainer(tm, setting, seed, private_copy=False)
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
    except OSError:
        return None
    for k in range(scale.memory_steps):
        trainer.step(batch, k)
    return (_status_kib("VmHWM") - before) * 1024


def peak_memory_bytes(model_name: str, setting: str, scale: Scale, seed: int) -> int | None:
    """Each setting in its own spawned process, so no allocator cache is shared between settings."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        result: int | None = pool.apply(
            _memory_probe, (model_name, setting, scale, seed, torch.get_num_threads())
        )
    return result


def fixed_batch(tm: TextModel, scale: Scale, seed: int) -> TextBatch:
    """The ``batch_size`` longest of 4 x ``batch_size`` seeded WikiText-2 test lines (a full-width batch)."""
    data = sample(load_text_dataset("wikitext2", split="test"), 4 * scale.batch_size, seed=seed)
    texts = sorted(data.texts, key=len, reverse=True)[: scale.batch_size]
    return encode(texts, tm.tokenizer, max_tokens=scale.tokens, labels=[0] * scale.batch_size)


def run_model(model_name: str, scale: Scale, seed: int) -> dict[str, Any]:
    memory = {s: peak_memory_bytes(model_name, s, scale, seed) for s in COST_SETTINGS}
    tm = build_text_model(model_name, TASK.get(model_name, "classification"), seed=0)
    batch = fixed_batch(tm, scale, seed)
    trainers = {s: Trainer(tm, s, seed) for s in COST_SETTINGS}
    times: dict[str, list[float]] = {s: [] for s in COST_SETTINGS}
    order = list(COST_SETTINGS)
    for r in range(scale.warmup + scale.rounds):
        for s in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            trainers[s].step(batch, r)
            if r >= scale.warmup:
                times[s].append(time.perf_counter() - t0)
        done = ", ".join(f"{s} {times[s][-1]:.2f}s" for s in order if times[s])
        print(f"  {model_name} round {r}: {done}", flush=True)
    out: dict[str, Any] = {"model": model_name, "tokens": int(batch.attention_mask.sum()), "settings": {}}
    for s in COST_SETTINGS:
        sent, full = trainers[s].payload_bytes()
        ratios = [a / b for a, b in zip(times[s], times["none"], strict=True)]
        mem, mem0 = memory[s], memory["none"]
        out["settings"][s] = {
            "step_seconds_median": statistics.median(times[s]),
            "step_time_ratio": statistics.median(ratios),
            "peak_memory_gib": None if mem is None else mem / GIB,
            "peak_memory_ratio": None if mem is None or not mem0 else mem / mem0,
            "payload_gib": sent / GIB,
            "payload_ratio": sent / full,
            "full_state_gib": full / GIB,
            "step_seconds": times[s],
        }  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], RESULTS_DIR)
    parser.add_argument("--models", nargs="+", default=None, help="override the scale's models")
    args = parse_args(parser, argv)
    scale = SCALES[args.scale]
    if args.models:
        scale = Scale(tuple(args.models), *list(asdict(scale).values())[1:])
    name = NAME if not args.models else f"{NAME}_{'_'.join(args.models)}"
    threads = configure_torch(args.threads)
    seed = args.seeds[0]
    print(f"{NAME} --scale {args.scale}: {scale}, settings {COST_SETTINGS}, seed {seed}", flush=True)
    results = [run_model(m, scale, seed) for m in scale.models]
    aegis = [r["settings"]["aegis_llm"] for r in results]
    payload = {
        "setting": {**asdict(scale), "settings": list(COST_SETTINGS), "optimizer": "AdamW lr 5e-5",
                    "batch": "the longest of 4 x batch_size seeded WikiText-2 test lines, <= `tokens`"},
        "torch_threads": threads,
        "target_time_ratio": TARGET_TIME_RATIO,
        "meets_time_target": all(a["step_time_ratio"] <= TARGET_TIME_RATIO for a in aegis),
        "meets_memory_target": all((a["peak_memory_ratio"] or 0) <= 1.0 for a in aegis),
        "paper": {"time_ratio_gpt2_gpt2xl_llama7b": [1.10, 1.12, 1.22],
                  "peak_memory_gib_gpt2_none_aegis": [2.24, 2.01],
                  "payload_gib_gpt2_none_aegis": [0.464, 0.358]},
        "results": results,
    }  # fmt: skip
    path = write_result(name, args.scale, payload, seeds=[seed], out=args.out)
    print("| model | setting | step s | x none | peak MiB | x none | payload MiB | x full |")
    for r in results:
        for s, v in r["settings"].items():
            mem = "n/a" if v["peak_memory_gib"] is None else f"{v['peak_memory_gib'] * 1024:.0f}"
            cells = [r["model"], s, f"{v['step_seconds_median']:.3f}", f"{v['step_time_ratio']:.3f}", mem,
                     f"{v['peak_memory_ratio'] or 0:.3f}", f"{v['payload_gib'] * 1024:.0f}",
                     f"{v['payload_ratio']:.3f}"]  # fmt: skip
            print("| " + " | ".join(cells) + " |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""gradleak's TAG and LAMP beside the official code on the same sentences (issue 53, item 3's side by side).

The official implementation is eth-sri/lamp (Apache-2.0; TAG's public implementation lives there too, as
its ``--baseline --loss tag`` mode). Fetch the repository and pass its checkout with ``--lamp``; its
``attack.py``, ``utilities.py``, ``init.py`` and ``constants.py`` are read from there and run as they are,
never copied into gradleak. What the official script needs and cannot have here is stood in for, none of it
on the path measured:

- ``args_factory.get_args`` returns the options of the official scripts (``tag.sh``: ``--baseline --loss tag
  --lr 0.1 --lr_decay 1 --tag_factor 0.01``; ``lamp_cos.sh``: ``--loss cos --coeff_perplexity 0.2
  --coeff_reg 1 --lr 0.01 --lr_decay 0.89``; the rest ``args_factory``'s defaults) with the step and start
  budgets of ``--scale``, on the CPU;
- ``datasets``, ``nlp_utils`` and ``data_utils`` (data and model downloads, not called by ``reconstruct``)
  are stubs that raise if called; ``transformers.AdamW`` and ``BeamSearchScorer`` (imported, unused; gone
  from transformers 5) are given torch's AdamW and a placeholder;
- the ROUGE metric (``datasets.load_metric``, a download) is rouge-score's, which the official code wraps;
- ``--use_embedding`` (the official option): the official code, too, reads the vocabulary off the
  embedding gradient's non-zero rows, as gradleak does by default (the scripts leave it off);
- the language model: LAMP's prior is a GPT-2 with BERT's vocabulary trained on WikiText-103, not offline.
  Both sides run without it (``coeff_perplexity`` 0; the official ``get_loss`` still calls the model, so a
  1-layer GPT-2 with that vocabulary stands in, weighted by 0): LAMP's own ablation without the prior.

Identical inputs: the same MiniLM classifier (``minilm``: real weights, a seeded head), the same Rotten
Tomatoes sentences and labels (the official threat model grants them), one sentence at a time (B = 1,
the default) or ``--batch B`` sentences of one token length a batch, the same budgets, one thread. Equal
lengths keep padding out: the official ``compute_grads`` passes no attention mask, so its client attends
its [PAD] tokens where gradleak's masks them, and the two would attack different updates. The official
code computes the client's gradient itself from the sentences (``compute_grads``, eval mode); gradleak's
from the same ids (``fedsgd_text_update``, eval mode). Known
difference of threat model: the official code knows where [CLS] and [SEP] are (``know_padding``,
``fix_special_tokens``); gradleak reads T off the gradient and, by default, pins nothing. So gradleak runs
twice: with its defaults (``ours``) and with [CLS] and [SEP] pinned as the official code pins them
(``first_token_id`` 101, ``last_token_id`` 102: ``ours_pinned``). Scores: ROUGE-1/2 and exact sequences of
the text each returns (special tokens dropped), against the decoded sentence, and the wall time of each
attack call: the official one includes computing the client's gradient and its Python loop over the
vocabulary (``use_embedding``), gradleak's its model copy and vocabulary read. Other defaults kept as each
side has them: LAMP's start norm is the official 1.4 (BERT-base's) against gradleak's mean norm of the
vocabulary's embeddings; each side draws from its own seed (official 101, gradleak a stream derived from
the run seed: :func:`attack_generator`; before it, the run seed itself, the one the head was drawn from).

    python benchmarks/lamp_official.py --lamp /path/to/lamp --scale small --threads 1 [--batch 2]
        [--methods tag,lamp] [--count N] [--arms official,ours,ours_pinned,ours_pinned_equal_time]
        [--attack-seed K]

``--count`` runs N sentences (B = 1) or batches instead of the scale's; ``--methods`` and ``--arms`` run
some of each; ``--attack-seed K`` shifts both sides' attack seeds by K (the model and sentences stay), for
the spread over starts. The ``ours_pinned_equal_time`` arm (off by default) is quality at equal time, the
counterpart of the issue's "time to the same quality": gradleak pinned, its step budget scaled by the
official call's seconds over the pinned call's on the same input (:func:`equal_time_steps`); its time ratio
to the official call is in the summary beside its scores (fixed costs do not scale with steps, so the ratio
is not exactly 1), and a longer budget also stretches the schedules that count steps (LAMP's learning-rate
decay, its swap burn-in). A run narrower than the default writes its own result file (:func:`result_name`).

At ``--batch`` B > 1 a scale runs ``BATCHES[scale]`` batches (smoke 1, small 2, paper 5), the first to
fill up with B sentences of one length (so not B = 1's sentences), and every score is the batch's, each
side's texts matched to the references by :func:`score_texts` (the official code's own matching only
reorders its output).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.attacks import create_attack
from gradleak.attacks.text.family import vocab_size
from gradleak.data.text import encode, load_text_dataset, sample
from gradleak.experiments.measurement import configure_torch, make_parser, parse_args, write_result
from gradleak.federation.simulation import derive_seed
from gradleak.metrics.text import decode, score_texts
from gradleak.models import build_model
from gradleak.tasks.text_client import fedsgd_text_update
from gradleak.types import Observation

HERE = Path(__file__).resolve().parent
NAME = "lamp_official"
FILES = ("attack.py", "utilities.py", "init.py", "constants.py", "args_factory.py")

# (sentences, TAG steps, LAMP steps, LAMP starts) per scale; the official budgets are 2,500 / 2,000 / 500
SCALE = {"smoke": (1, 20, 20, 5), "small": (3, 500, 500, 100), "paper": (10, 2500, 2000, 500)}
BATCHES = {"smoke": 1, "small": 2, "paper": 5}  # batches a scale runs at --batch > 1
MAX_TOKENS = 32
ARMS = ("official", "ours", "ours_pinned", "ours_pinned_equal_time")
DEFAULT_ARMS = ARMS[:3]
METHODS = ("tag", "lamp")
PINS = {"first_token_id": 101, "last_token_id": 102}  # BERT's [CLS] and [SEP], as the official code pins


def official_args(method: str, scale: str, batch: int = 1, attack_seed: int = 0) -> types.SimpleNamespace:
    """``args_factory.get_args()`` of the official script for ``method`` at ``scale``'s budgets; its seed
    is the script's 101 plus ``attack_seed``."""
    _, tag_steps, lamp_steps, starts = SCALE[scale]
    base = dict(
        neptune=None, rng_seed=101 + attack_seed, baseline=False, dataset="rotten_tomatoes", split="test",
        batch_size=batch,
        defense_noise=None, defense_pct_mask=None, device="cpu", opt_alg="adam", init="random",
        use_swaps=True, use_swaps_at_end=False, swap_burnin=0.1, swap_every=75, use_embedding=True,
        know_padding=True, init_size=1.4, lr_decay_type="StepLR", grad_clip=None, print_every=10**9,
    )  # fmt: skip
    if method == "tag":  # tag.sh, then get_args' --baseline
        own = dict(baseline=True, loss="tag", lr=0.1, lr_decay=1.0, tag_factor=0.01, n_steps=tag_steps,
                   init_candidates=1, use_swaps=False, init_size=-1, coeff_perplexity=0.0,
                   coeff_reg=0.0)  # fmt: skip
    else:  # lamp_cos.sh without the prior (module docstring)
        own = dict(loss="cos", coeff_perplexity=0.0, coeff_reg=1.0, lr=0.01, lr_decay=0.89, tag_factor=None,
                   n_steps=lamp_steps, init_candidates=starts)  # fmt: skip
    args = {**base, **own}
    args["lr_max_it"] = args["n_steps"]
    return types.SimpleNamespace(**args)


class _Rouge:
    """``datasets.load_metric('rouge')`` as the official code reads it: ``compute(...)[key].mid.fmeasure``."""

    def compute(self, predictions: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
        from rouge_score import rouge_scorer

        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2"], use_stemmer=True)
        scores = [scorer.score(r, p) for p, r in zip(predictions, references, strict=True)]
        out = {}
        for key in ("rouge1", "rouge2"):
            f = statistics.fmean(s[key].fmeasure for s in scores)
            out[key] = types.SimpleNamespace(mid=types.SimpleNamespace(fmeasure=f))
        return out


def _unavailable(what: str) -> Any:
    def call(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"{what} is not available offline and is not on the measured path")

    return call


def load_official(root: Path, args: types.SimpleNamespace) -> types.ModuleType:
    """The official ``attack.py`` as a module, its imports resolved from ``root`` and the stand-ins. Loaded
    once: its module-level ``args`` (from ``get_args``) only seeds at import; ``reconstruct`` and everything
    it calls take the options as an argument."""
    import transformers

    stubs = {
        "datasets": {"load_metric": _unavailable("datasets.load_metric"),
                     "load_dataset": _unavailable("datasets.load_dataset")},
        "nlp_utils": {"load_gpt2_from_dict": _unavailable("the WikiText-103 GPT-2")},
        "data_utils": {"TextDataset": _unavailable("the official data loader")},
        "args_factory": {"get_args": lambda: args},
    }  # fmt: skip
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    for name, value in (("AdamW", torch.optim.AdamW), ("BeamSearchScorer", object)):
        if not hasattr(transformers, name):
            setattr(transformers, name, value)
    sys.path.insert(0, str(root))
    module = types.ModuleType("lamp_attack")
    module.__file__ = str(root / "attack.py")
    source = (root / "attack.py").read_text(encoding="utf-8")
    exec(compile(source, str(root / "attack.py"), "exec"), module.__dict__)  # noqa: S102 (the authors' file)
    return module


def stand_in_lm(vocab: int) -> torch.nn.Module:
    """A 1-layer GPT-2 with BERT's vocabulary: the official ``get_loss`` calls the prior; its weight is 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2)).eval()


def _clean(text: str) -> str:
    for special in ("[CLS]", "[SEP]", "[PAD]"):
        text = text.replace(special, " ")
    return " ".join(text.split())


def batches(tok: Any, n: int, size: int, seed: int) -> list[list[tuple[str, int]]]:
    """The first ``n`` batches of ``size`` Rotten Tomatoes sentences (a seeded order) of one token length,
    at most ``MAX_TOKENS``: the official code tokenizes without a length limit, so both sides see the whole
    sentence, and one length a batch leaves no padding (module docstring)."""
    data = load_text_dataset("rotten_tomatoes", "all")
    assert data.labels is not None
    labels = dict(zip(data.texts, data.labels, strict=True))
    waiting: dict[int, list[str]] = {}
    out: list[list[tuple[str, int]]] = []
    for text in sample(data, len(data), seed=seed).texts:
        length = len(tok(text)["input_ids"])
        if length > MAX_TOKENS:
            continue
        group = waiting.setdefault(length, [])
        group.append(text)
        if len(group) == size:
            out.append([(t, int(labels[t])) for t in group])
            del waiting[length]
            if len(out) == n:
                return out
    raise ValueError(f"Rotten Tomatoes holds fewer than {n} batches of {size} equal-length sentences")


ATTACK_SALT = 0x7A6  # gradleak's attack stream, apart from the run seed's (the model's head is drawn from it)


def attack_generator(seed: int, attack_seed: int) -> torch.Generator:
    """gradleak's attack generator: a stream derived from the run seed, the attack seed and a salt. Not the
    run seed itself: ``build_model`` draws MiniLM's fresh classifier head from ``torch.manual_seed(seed)``,
    so an attack generator seeded with ``seed`` starts TAG with the head's rows at positions 0 and 1 (runs
    before this function: gradleak's arms at ``--attack-seed 0``)."""
    return torch.Generator().manual_seed(derive_seed(seed, ATTACK_SALT, attack_seed))


def equal_time_steps(steps: int, official_seconds: float, pinned_seconds: float) -> int:
    """The ``ours_pinned_equal_time`` arm's step budget: ``steps`` scaled by the official call's time over
    the pinned call's on the same input, so that it spends about the official code's time (quality at equal
    time, the counterpart of the issue's "time to the same quality")."""
    return max(1, round(steps * official_seconds / pinned_seconds))


def check_selection(arms: Sequence[str], methods: Sequence[str]) -> None:
    """``ValueError`` unless ``arms`` and ``methods`` are distinct names of :data:`ARMS` and
    :data:`METHODS` and the equal-time arm has the two it scales by (``official``, ``ours_pinned``)."""
    for given, known, what in ((arms, ARMS, "arms"), (methods, METHODS, "methods")):
        if not given or len(set(given)) != len(given) or not set(given) <= set(known):
            raise ValueError(f"{what} takes distinct names of {known}, got {list(given)}")
    if "ours_pinned_equal_time" in arms and not {"official", "ours_pinned"} <= set(arms):
        raise ValueError("the ours_pinned_equal_time arm needs the official and ours_pinned arms beside it")


def run(
    lamp: Path, scale: str, seed: int, size: int = 1, *, arms: Sequence[str] = DEFAULT_ARMS,
    methods: Sequence[str] = METHODS, count: int | None = None, attack_seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Every arm of ``arms`` on ``count`` sentences (B = 1) or batches (default: the scale's) for each of
    ``methods``; ``ours_pinned_equal_time`` needs the ``official`` and ``ours_pinned`` arms beside it.
    ``attack_seed`` shifts both sides' attack seeds (official 101 + it, gradleak :func:`attack_generator`)
    and nothing else: the model, its head and the sentences stay those of ``seed``."""
    check_selection(arms, methods)
    n, tag_steps, lamp_steps, starts = SCALE[scale]
    n = count if count is not None else n if size == 1 else BATCHES[scale]

    def shown(texts: list[str]) -> str | list[str]:
        """A row's texts: the one sentence's at B = 1 (the rows as before ``--batch``), else the batch's."""
        return texts[0] if size == 1 else texts

    tm = build_model("minilm", (MAX_TOKENS,), 2, task="classification", seed=seed)
    model, tok = tm.model.eval(), tm.tokenizer
    lm = stand_in_lm(vocab_size(model))
    official = load_official(lamp, official_args("tag", scale, size))
    rows: list[dict[str, Any]] = []
    for k, group in enumerate(batches(tok, n, size, seed)):
        texts_in, labels = [t for t, _ in group], [y for _, y in group]
        batch = encode(texts_in, tok, max_tokens=MAX_TOKENS, labels=labels)
        truth = decode(tok, batch.sequences())
        update = fedsgd_text_update(model, batch, "classification")
        obs = Observation(model, update, (batch.input_ids.shape[1],), 2, labels=batch.labels)
        for method in methods:
            args = official_args(method, scale, size, attack_seed)
            steps = tag_steps if method == "tag" else lamp_steps
            extra = {} if method == "tag" else dict(init_candidates=starts, swap_tries=200)
            texts: dict[str, list[str]] = {}
            seconds: dict[str, float] = {}
            reference: list[str] = []
            if "official" in arms:
                np.random.seed(args.rng_seed)
                torch.manual_seed(args.rng_seed)
                random.seed(args.rng_seed)
                start = time.perf_counter()
                prediction, reference = official.reconstruct(
                    args, torch.device("cpu"), (texts_in, torch.tensor(labels)), _Rouge(), tok, lm, model
                )
                seconds["official"] = time.perf_counter() - start
                texts["official"] = [_clean(p) for p in prediction]
            budgets = {"ours": (steps, {}), "ours_pinned": (steps, PINS)}
            for arm in [a for a in ARMS[1:] if a in arms]:
                if arm == "ours_pinned_equal_time":
                    scaled = equal_time_steps(steps, seconds["official"], seconds["ours_pinned"])
                    budgets[arm] = (scaled, PINS)
                arm_steps, pins = budgets[arm]
                attack = create_attack(method, steps=arm_steps, **extra, **pins)
                start = time.perf_counter()
                rec = attack.reconstruct(obs, generator=attack_generator(seed, attack_seed))
                seconds[arm] = time.perf_counter() - start
                texts[arm] = decode(tok, rec.token_ids or [[]])
            row: dict[str, Any] = {"sentence" if size == 1 else "batch": k, "method": method,
                                   "truth": shown(truth)}  # fmt: skip
            if "official" in arms:
                row["official_reference"] = shown([_clean(r) for r in reference])
            if "ours_pinned_equal_time" in arms:
                row["steps_ours_pinned_equal_time"] = budgets["ours_pinned_equal_time"][0]
            for arm in arms:
                scores = score_texts(texts[arm], truth)
                row |= {arm: shown(texts[arm]), f"rouge1_{arm}": scores.rouge1,
                        f"rouge2_{arm}": scores.rouge2, f"exact_{arm}": scores.exact,
                        f"seconds_{arm}": seconds[arm]}  # fmt: skip
            rows.append(row)
            print(rows[-1], flush=True)
    summary: dict[str, dict[str, float]] = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        keys = [f"{score}_{arm}" for score in ("rouge1", "rouge2", "exact", "seconds") for arm in arms]
        if "ours_pinned_equal_time" in arms:
            keys.append("steps_ours_pinned_equal_time")
        summary[method] = {key: statistics.fmean(r[key] for r in mine) for key in keys}
        for arm in [a for a in arms if a != "official" and "official" in arms]:
            summary[method][f"time_ratio_{arm}_over_official"] = (
                summary[method][f"seconds_{arm}"] / summary[method]["seconds_official"]
            )
    return {"model": "minilm", "dataset": "rotten_tomatoes", "batch_size": size, "max_tokens": MAX_TOKENS,
            "budgets": {"tag_steps": tag_steps, "lamp_steps": lamp_steps, "lamp_starts": starts,
                        "lamp_swap_tries": 200, "prior": "none (coeff_perplexity 0 on both sides)",
                        "equal_time_steps": "the steps x official seconds / ours_pinned seconds, per input"},
            "arms": list(arms), "methods": list(methods), "attack_seed": attack_seed,
            "summary": summary, "rows": rows}  # fmt: skip


def result_name(
    batch: int, methods: Sequence[str], count: int | None, arms: Sequence[str], attack_seed: int = 0
) -> str:
    """The result file's name: ``lamp_official`` for the default run, suffixed by what differs from it (so a
    narrower run never overwrites the full one)."""
    name = NAME if batch == 1 else f"{NAME}_b{batch}"
    if tuple(methods) != METHODS:
        name += "_" + "_".join(methods)
    if count is not None:
        name += f"_n{count}"
    if tuple(arms) != DEFAULT_ARMS:
        name += "_" + "_".join(arms)
    if attack_seed:
        name += f"_attack_seed{attack_seed}"
    return name


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser(__doc__.splitlines()[0], HERE / "results")
    parser.add_argument("--lamp", type=Path, required=True, help="a checkout of eth-sri/lamp")
    parser.add_argument("--batch", type=int, default=1, help="sentences a batch, of one length (default 1)")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {ARMS}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {METHODS}")
    parser.add_argument(
        "--count", type=int, default=None, help="sentences (B = 1) or batches (default: the scale's)"
    )
    parser.add_argument(
        "--attack-seed", type=int, default=0, help="shift both sides' attack seeds only (default 0)"
    )
    args = parse_args(parser, argv)
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    if args.count is not None and args.count < 1:
        parser.error(f"--count must be >= 1, got {args.count}")
    arms, methods = args.arms.split(","), args.methods.split(",")
    try:
        check_selection(arms, methods)
    except ValueError as err:
        parser.error(f"--arms / --methods: {err}")
    for name in FILES:
        if not (args.lamp / name).is_file():
            raise SystemExit(f"{args.lamp / name} not found: pass a checkout of eth-sri/lamp as --lamp")
    threads = configure_torch(args.threads)
    arms = [a for a in ARMS if a in arms]  # the run order: the equal-time arm after the two it scales by
    methods = [m for m in METHODS if m in methods]
    payload = {
        **run(
            args.lamp,
            args.scale,
            args.seeds[0],
            args.batch,
            arms=arms,
            methods=methods,
            count=args.count,
            attack_seed=args.attack_seed,
        ),
        "threads": threads,
    }
    name = result_name(args.batch, methods, args.count, arms, args.attack_seed)
    out = write_result(name, args.scale, payload, seeds=args.seeds, out=args.out)
    print(f"wrote {out}: {payload['summary']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What an experiment trains and how its audit is scored, one :class:`Setup` per data modality.

:func:`build_setup` reads the data set's modality from :data:`gradleak.registry.DATASETS` and builds, before
any training, the train and test data, the global model, the :class:`~gradleak.tasks.Task` every client
trains and the server's public data; the setup then scores a reconstruction against the truth and
measures its no-information floor in the same run:

- images (:class:`ImageSetup`): PSNR, SSIM, reconstruction rate, label accuracy of the matched images;
  floors from random same-class and class-mean public images (:mod:`gradleak.metrics.floors`);
- text (:class:`TextSetup`): ROUGE-1/2/L, METEOR and the exact-sequence rate of the matched sequences (or
  of the recovered token set, for an attack that returns one); floor: the same attack on a norm-matched
  random update (paper 002's null, Sec. VI-C), and paper 002's validity gate.

The runner (:mod:`gradleak.experiments.runner`) is the same for every modality.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from gradleak.attacks.text.baseline import is_valid, null_observation
from gradleak.data import load_dataset, resolve_data_root
from gradleak.data.base import ImageDataset
from gradleak.experiments.config import ConfigError, ExperimentConfig
from gradleak.fl import derive_seed
from gradleak.metrics import score_images
from gradleak.metrics.floors import beyond_floor, null_floors
from gradleak.models import build_model
from gradleak.registry import DATASETS, MODELS
from gradleak.tasks import (
    IMAGE_CLASSIFICATION,
    TASKS,
    TEXT_TASK_OF_MODEL,
    Dataset,
    Task,
)
from gradleak.text.data import TextDataset, TokenDataset
from gradleak.text.metrics import decode, score_texts, score_token_set
from gradleak.types import Attack, AttackInputError, Observation, Reconstruction

log = logging.getLogger(__name__)
SHOWN_TEXTS = 16  # reconstructed and true texts kept in a record (for the report)


class Setup(Protocol):
    """An experiment's built inputs and its scoring (module docstring)."""

    train: Any
    test: Any
    model: nn.Module
    task: Task
    public: ImageDataset | None  # the server's auxiliary data, where its attacks use some

    @property
    def input_shape(self) -> tuple[int, ...]: ...

    @property
    def num_classes(self) -> int: ...

    def score(self, rec: Reconstruction, truth: Any) -> dict[str, Any]: ...

    def floors(
        self, attack: Attack, obs: Observation, truth: Any, scores: dict[str, Any], generator: torch.Generator
    ) -> dict[str, Any]: ...


def label_accuracy(recovered: torch.Tensor | None, truth: torch.Tensor | None) -> float | None:
    """Fraction of true labels recovered, as multisets (order-free); None when either is missing."""
    if recovered is None or truth is None:
        return None
    hit = Counter(recovered.tolist()) & Counter(truth.tolist())
    return sum(hit.values()) / max(1, len(truth))


def load_split_data(cfg: ExperimentConfig) -> tuple[Any, Any]:
    """Train and test sets (images, or a text data set's raw texts); when both name the same split, a
    seeded ``holdout`` share becomes the test set."""
    d = cfg.data
    root = resolve_data_root(cfg.experiment.data_root)
    if d.train_split != d.test_split:
        train = load_dataset(d.dataset, d.train_split, root, d.train_limit, d.options)
        test = load_dataset(d.dataset, d.test_split, root, d.test_limit, d.options)
        return train, test
    full = load_dataset(d.dataset, d.train_split, root, None, d.options)
    order = np.random.default_rng(derive_seed(cfg.experiment.seed, 0xDA7A)).permutation(len(full))
    n_test = max(1, int(round(d.holdout * len(full))))
    test_idx, train_idx = order[:n_test], order[n_test:]
    if d.test_limit is not None:
        test_idx = test_idx[: d.test_limit]
    if d.train_limit is not None:
        train_idx = train_idx[: d.train_limit]
    return full.subset(np.sort(train_idx)), full.subset(np.sort(test_idx))


def model_seed(cfg: ExperimentConfig) -> int:
    return cfg.model.seed if cfg.model.seed is not None else derive_seed(cfg.experiment.seed, 0x30DE)


# ----------------------------------------------------------------------------------------------- images


def load_public_data(cfg: ExperimentConfig, test: ImageDataset) -> ImageDataset:
    """The server's auxiliary data (images and labels): a configured public set, else the held-out test
    set; the first ``audit.public_limit``. Malicious-model attacks build from its images; the null floors
    (:mod:`gradleak.metrics.floors`) draw from it."""
    a = cfg.audit
    if a.public_dataset is None and a.public_split is None:
        data = test
    else:
        root = resolve_data_root(cfg.experiment.data_root)
        name = a.public_dataset or cfg.data.dataset
        options = cfg.data.options if name == cfg.data.dataset else None  # the loader's own options
        data = load_dataset(name, a.public_split, root, None, options)
    limit = len(data) if a.public_limit is None else min(a.public_limit, len(data))
    return data.subset(np.arange(limit))


def check_public_images(
    public: ImageDataset | None, input_shape: tuple[int, ...], cfg: ExperimentConfig
) -> None:
    """The server's auxiliary images must have the task's image shape (checked before any training)."""
    if public is None:
        return
    if not isinstance(public, ImageDataset) or tuple(public.input_shape) != tuple(input_shape):
        name = cfg.audit.public_dataset or cfg.data.dataset
        shape = tuple(public.input_shape) if isinstance(public, ImageDataset) else type(public).__name__
        raise ConfigError(
            f"audit.public_dataset = {name!r} gives images of shape {shape}, but the task's images are "
            f"{tuple(input_shape)}: the malicious-model attacks and the null floors need public data of "
            "that shape"
        )
    if len(public) < 2:
        raise ConfigError(f"audit.public_limit leaves {len(public)} public image(s); the attacks need >= 2")


def score_reconstruction(rec: Reconstruction, truth: ImageDataset) -> dict[str, Any]:
    """Label accuracy and (for images) every image score of ``rec`` against the true ``truth``."""
    out: dict[str, Any] = {"label_accuracy": label_accuracy(rec.labels, truth.labels)}
    if rec.images is not None:
        out.update(score_images(rec.images, truth.images).to_dict())
    return out


@dataclass
class _Built:
    """What every setup holds: the data, the global model and the task."""

    train: Any
    test: Any
    model: nn.Module
    task: Task

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.input_shape)

    @property
    def num_classes(self) -> int:
        return int(self.train.num_classes)


@dataclass
class ImageSetup(_Built):
    """Image classification: the CNN every client trains, its data, the server's public images."""

    public: ImageDataset | None

    def score(self, rec: Reconstruction, truth: ImageDataset) -> dict[str, Any]:
        return score_reconstruction(rec, truth)

    def floors(
        self, attack: Attack, obs: Observation, truth: ImageDataset, scores: dict[str, Any],
        generator: torch.Generator,
    ) -> dict[str, Any]:  # fmt: skip
        """Random same-class and class-mean public images scored like a reconstruction, and the leakage
        above the higher floor."""
        if "psnr_mean" not in scores or self.public is None:
            return {}
        out = null_floors(truth, self.public, generator)
        return {**out, **beyond_floor({**scores, **out})}


def image_setup(cfg: ExperimentConfig) -> ImageSetup:
    train, test = load_split_data(cfg)
    public = load_public_data(cfg, test) if cfg.audit.clients > 0 else None
    check_public_images(public, train.input_shape, cfg)
    model = build_model(cfg.model.name, train.input_shape, train.num_classes, seed=model_seed(cfg),
                        **cfg.model.options)  # fmt: skip
    return ImageSetup(train, test, model, IMAGE_CLASSIFICATION, public)


# ------------------------------------------------------------------------------------------------- text

TEXT_SCORES = ("rouge1", "rouge2", "rougeL", "meteor", "exact")


@dataclass
class TextSetup(_Built):
    """A transformer fine-tuned on tokenized text (text classification or causal LM)."""

    tokenizer: Any
    public: ImageDataset | None = None

    def score(self, rec: Reconstruction, truth: TokenDataset) -> dict[str, Any]:
        """ROUGE/METEOR/exact of the matched sequences (an unordered token set: against the batch's
        tokens), label accuracy, and the first reconstructed and true texts."""
        refs = truth.batch().sequences()
        found = rec.token_ids or []
        hyps, true = decode(self.tokenizer, found), decode(self.tokenizer, refs)
        if rec.ordered:
            scores = score_texts(hyps, true)
            matched = [""] * len(true)  # each true sequence's matched reconstruction
            for i, j in scores.pairs:
                matched[j] = hyps[i]
        else:
            scores = score_token_set([t for seq in found for t in seq], refs, self.tokenizer)
            matched = []
        return {**scores.as_dict(), "label_accuracy": label_accuracy(rec.labels, truth.labels),
                "recovered_sequences": len(found), "texts": hyps[:SHOWN_TEXTS],
                "true_texts": true[:SHOWN_TEXTS], "matched_texts": matched[:SHOWN_TEXTS]}  # fmt: skip

    def floors(
        self, attack: Attack, obs: Observation, truth: TokenDataset, scores: dict[str, Any],
        generator: torch.Generator,
    ) -> dict[str, Any]:  # fmt: skip
        """The attack on a norm-matched random update in place of the client's (paper 002's null),
        scored the same way: ``floor_null_<score>``, ``<score>_beyond_floor`` and the validity gate."""
        null_gen = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
        null = null_observation(obs, generator)
        try:
            rec = attack.reconstruct(null, generator=null_gen)
        except AttackInputError:  # the attack finds nothing to read in noise: it recovers nothing
            rec = Reconstruction(token_ids=[])
        floor = self.score(rec, truth)
        out: dict[str, Any] = {f"floor_null_{k}": floor[k] for k in TEXT_SCORES}
        for k in TEXT_SCORES:
            if isinstance(scores.get(k), int | float) and isinstance(floor[k], int | float):
                out[f"{k}_beyond_floor"] = float(scores[k]) - float(floor[k])
        out["valid"] = is_valid(float(scores.get("rouge1") or 0.0), float(floor["rouge1"]))
        return out


def text_setup(cfg: ExperimentConfig) -> TextSetup:
    raw_train, raw_test = load_split_data(cfg)
    assert isinstance(raw_train, TextDataset) and isinstance(raw_test, TextDataset)
    entry = MODELS.entry(cfg.model.name)
    if entry.modality != "text":
        raise ConfigError(f"model.name = {cfg.model.name!r} is not a text model; data.dataset is text")
    task_name = str(cfg.model.task or getattr(entry.factory, "default_task", "classification"))
    if task_name == "classification" and raw_train.labels is None:
        raise ConfigError(
            f'data.dataset = {cfg.data.dataset!r} has no labels: set model.task = "causal_lm" '
            "(language modelling) or use a labelled data set"
        )
    max_tokens = DATASETS.make_config(cfg.data.dataset, cfg.data.options).max_tokens
    try:
        tm = entry.factory((max_tokens,), raw_train.num_labels, task=task_name, seed=model_seed(cfg),
                           **cfg.model.options)  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model {cfg.model.name!r} ({task_name}): {exc}") from None
    train = TokenDataset.from_texts(raw_train, tm.tokenizer, max_tokens=max_tokens)
    test = TokenDataset.from_texts(raw_test, tm.tokenizer, max_tokens=max_tokens)
    task: Task = TASKS[TEXT_TASK_OF_MODEL[task_name]]()
    return TextSetup(train, test, tm.model, task, tm.tokenizer)


SETUPS: dict[str, Callable[[ExperimentConfig], Setup]] = {"image": image_setup, "text": text_setup}


def build_setup(cfg: ExperimentConfig) -> Setup:
    """The setup of ``cfg``'s data modality (a plugin data set without one is an image task)."""
    modality = DATASETS.entry(cfg.data.dataset).modality or "image"
    return SETUPS[modality](cfg)


def concat(parts: list[Dataset]) -> Dataset:
    """The data behind an aggregate: the parts one after the other."""
    return type(parts[0]).concat(parts)  # type: ignore[arg-type]

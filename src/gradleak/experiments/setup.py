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

The scoring itself is :mod:`gradleak.audit.scoring`'s, shared with the Flower wrappers; the runner
(:mod:`gradleak.experiments.runner`) is the same for every modality.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch import nn

from gradleak.audit.scoring import ImageScorer, Scorer, TextScorer
from gradleak.data import load_dataset, resolve_data_root
from gradleak.data.base import ImageDataset
from gradleak.data.text import TextDataset, TokenDataset
from gradleak.experiments.config import ConfigError, ExperimentConfig
from gradleak.federation import derive_seed
from gradleak.models import build_model
from gradleak.models.adapters import apply_adapter
from gradleak.models.architecture import SPEC_ATTRIBUTE, RegisteredModel
from gradleak.models.text import TextModel
from gradleak.registry import DATASETS, MODELS, TASKS
from gradleak.tasks import (
    IMAGE_CLASSIFICATION,
    TEXT_TASK_OF_MODEL,
    Dataset,
    ImageClassification,
    Task,
)

log = logging.getLogger(__name__)


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

    @property
    def scorer(self) -> Scorer: ...


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

    @property
    def scorer(self) -> Scorer:
        return ImageScorer(self.public)


def image_setup(cfg: ExperimentConfig) -> ImageSetup:
    train, test = load_split_data(cfg)
    public = load_public_data(cfg, test) if cfg.audit.clients > 0 else None
    check_public_images(public, train.input_shape, cfg)
    model = build_model(cfg.model.name, train.input_shape, train.num_classes, seed=model_seed(cfg),
                        **cfg.model.options)  # fmt: skip
    task = IMAGE_CLASSIFICATION if cfg.model.mode is None else ImageClassification(mode=cfg.model.mode)
    return ImageSetup(train, test, model, task, public)


# ------------------------------------------------------------------------------------------------- text


@dataclass
class TextSetup(_Built):
    """A transformer fine-tuned on tokenized text (text classification or causal LM)."""

    tokenizer: Any
    public: ImageDataset | None = None

    @property
    def scorer(self) -> Scorer:
        return TextScorer(self.tokenizer)


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
    if not isinstance(tm, TextModel):
        raise ConfigError(
            f"model {cfg.model.name!r} is no text model (its factory gave a {type(tm).__name__})"
        )
    model = tm.model
    if cfg.model.adapter is not None:  # LoRA: only the adapters (and a trained head) train and travel
        if entry.modality != "text":
            raise ConfigError("model.adapter applies to the text models")
        try:
            model = apply_adapter(model, cfg.model.adapter, task_name, model_seed(cfg))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model.adapter: {exc}") from None
    options = {"task": task_name, **cfg.model.options}
    if cfg.model.adapter is not None:
        options["adapter"] = dataclasses.asdict(cfg.model.adapter)
    spec = RegisteredModel(
        cfg.model.name, (max_tokens,), max(1, raw_train.num_labels), model_seed(cfg), options
    )
    setattr(model, SPEC_ATTRIBUTE, spec)  # the Flower engine's nodes rebuild it from this (build_module)
    train = TokenDataset.from_texts(raw_train, tm.tokenizer, max_tokens=max_tokens)
    test = TokenDataset.from_texts(raw_test, tm.tokenizer, max_tokens=max_tokens)
    mode = {} if cfg.model.mode is None else {"mode": cfg.model.mode}
    task: Task = TASKS.create(TEXT_TASK_OF_MODEL[task_name], **mode)
    return TextSetup(train, test, model, task, tm.tokenizer)


SETUPS: dict[str, Callable[[ExperimentConfig], Setup]] = {"image": image_setup, "text": text_setup}


def build_setup(cfg: ExperimentConfig) -> Setup:
    """The setup of ``cfg``'s data modality (a plugin data set without one is an image task)."""
    modality = DATASETS.entry(cfg.data.dataset).modality or "image"
    return SETUPS[modality](cfg)


def concat(parts: list[Dataset]) -> Dataset:
    """The data behind an aggregate: the parts one after the other."""
    return type(parts[0]).concat(parts)  # type: ignore[arg-type]

"""What a client trains: the learning task (its data type, loss and evaluation metric).

One client loop (:func:`gradleak.tasks.client.train_client`), one
:class:`~gradleak.federation.FederatedSimulation`
and one runner serve every task; only the :class:`Task` differs:

- ``image_classification``: :class:`~gradleak.data.base.ImageDataset`, mean cross-entropy of
  ``model(images)`` (or the recipe's ``loss``, e.g. ``mse``), top-1 accuracy; trains in train mode
  (BatchNorm batch statistics, dropout on).
- ``text_classification``: :class:`~gradleak.data.text.TokenDataset`, the sequence-classification
  cross-entropy of a transformers model, top-1 accuracy.
- ``causal_lm``: :class:`~gradleak.data.text.TokenDataset`, mean next-token cross-entropy over real tokens
  (padded positions carry label -100), perplexity exp(token-weighted mean NLL) and next-token accuracy.

The text tasks train in eval mode by default (no dropout: the deterministic setting of paper 002 and
DAGER); ``dropout = true`` trains them in train mode. A task is a small frozen dataclass, rebuilt by name
from :data:`gradleak.registry.TASKS` where a client runs in another process (Flower's nodes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from gradleak.data.base import ImageDataset
from gradleak.data.text import TextBatch, TokenDataset
from gradleak.device import module_device
from gradleak.metrics.utility import accuracy, classify, next_token_scores, top1_accuracy
from gradleak.registry import LOSSES, TASKS

Dataset = ImageDataset | TokenDataset
EVAL_BATCH = 256


@runtime_checkable
class Task(Protocol):
    """A learning task: ``loss`` is what the client differentiates, ``evaluate`` the server's utility
    metrics (always ``accuracy``; a task may add others, e.g. ``perplexity``), ``mode`` the module mode
    local training runs in (``"train"`` or ``"eval"``), ``modality`` the data it takes."""

    name: ClassVar[str]
    modality: ClassVar[str]

    @property
    def mode(self) -> str: ...

    def loss(self, model: nn.Module, data: Any) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]: ...


def _check_mode(task: object) -> None:
    if getattr(task, "mode", None) not in ("train", "eval"):
        raise ValueError(f"{type(task).__name__}.mode must be 'train' or 'eval', got {task.mode!r}")  # type: ignore[attr-defined]


def _check(data: object, kind: type, task: str) -> None:
    if not isinstance(data, kind):
        raise TypeError(f"the {task} task trains on a {kind.__name__}, got a {type(data).__name__}")


@dataclass(frozen=True)
class ImageClassification:
    """Cross-entropy of ``model(images)`` against the labels (or the recipe's ``criterion``, a name in
    :data:`~gradleak.registry.LOSSES`); top-1 accuracy."""

    name: ClassVar[str] = "image_classification"
    modality: ClassVar[str] = "image"
    mode: str = "train"

    def __post_init__(self) -> None:
        _check_mode(self)

    def loss(self, model: nn.Module, data: ImageDataset, *, criterion: str = "cross_entropy") -> torch.Tensor:
        _check(data, ImageDataset, self.name)
        device = module_device(model)  # the data rests on the CPU; the model computes where it lives
        return LOSSES.create(criterion)(model(data.images.to(device)), data.labels.to(device))

    def evaluate(self, model: nn.Module, data: ImageDataset) -> dict[str, float]:
        return {"accuracy": top1_accuracy(model, data.images, data.labels)}


def text_loss(model: nn.Module, batch: TextBatch, task: str) -> torch.Tensor:
    """Mean cross-entropy of a transformers ``model`` on ``batch`` for ``task`` (causal_lm or
    classification): the model's own loss with ``labels`` (next-token, padded positions -100; or the
    class labels)."""
    if task == "causal_lm":
        labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    elif task == "classification":
        if batch.labels is None:
            raise ValueError("classification needs batch.labels")
        labels = batch.labels
    else:
        raise ValueError(f"task must be 'causal_lm' or 'classification', got {task!r}")
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels)
    loss: torch.Tensor = out.loss
    return loss


def _chunks(data: TokenDataset) -> list[TextBatch]:
    return [
        data.subset(range(i, min(i + EVAL_BATCH, len(data)))).batch() for i in range(0, len(data), EVAL_BATCH)
    ]


@dataclass(frozen=True)
class _TextTask:
    """A transformers model on a TokenDataset: ``head`` is :func:`text_loss`'s task."""

    name: ClassVar[str]
    head: ClassVar[str]
    modality: ClassVar[str] = "text"
    mode: str = "eval"

    def __post_init__(self) -> None:
        _check_mode(self)

    def loss(self, model: nn.Module, data: TokenDataset) -> torch.Tensor:
        _check(data, TokenDataset, self.name)
        return text_loss(model, data.batch().to(module_device(model)), self.head)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: TokenDataset) -> dict[str, float]:
        _check(data, TokenDataset, self.name)
        was = model.training
        model.eval()
        try:
            return self._metrics(model, data)
        finally:
            model.train(was)

    def _metrics(self, model: nn.Module, data: TokenDataset) -> dict[str, float]:
        raise NotImplementedError


@dataclass(frozen=True)
class TextClassification(_TextTask):
    """Sequence-classification cross-entropy; top-1 accuracy."""

    name: ClassVar[str] = "text_classification"
    head: ClassVar[str] = "classification"

    def _metrics(self, model: nn.Module, data: TokenDataset) -> dict[str, float]:
        if data.labels is None:
            raise ValueError(f"{data.name}: text classification needs labels")
        pred, true = classify(model, _chunks(data))
        return {"accuracy": accuracy(pred, true)}


@dataclass(frozen=True)
class CausalLM(_TextTask):
    """Next-token cross-entropy over real tokens; ``perplexity`` = exp(sum NLL / next-token positions) and
    ``accuracy`` = the share of those positions whose argmax is the next token."""

    name: ClassVar[str] = "causal_lm"
    head: ClassVar[str] = "causal_lm"

    def _metrics(self, model: nn.Module, data: TokenDataset) -> dict[str, float]:
        nll, hits, count = next_token_scores(model, _chunks(data))
        if count == 0:
            raise ValueError(f"{data.name}: no next-token positions to score")
        return {"accuracy": hits / count, "perplexity": math.exp(nll / count)}


for _task in (ImageClassification, TextClassification, CausalLM):
    TASKS.register(_task.name, _task, summary=(_task.__doc__ or "").split(";")[0], modality=_task.modality)
IMAGE_CLASSIFICATION = ImageClassification()
# the model factories' names for the text tasks
TEXT_TASK_OF_MODEL = {"classification": TextClassification.name, "causal_lm": CausalLM.name}


def task_spec(task: Task) -> dict[str, Any]:
    """A task as JSON: its name and fields (rebuilt by :func:`task_from_spec`)."""
    return {"name": task.name, **dataclasses.asdict(task)}  # type: ignore[call-overload]


def task_from_spec(spec: Mapping[str, Any]) -> Task:
    fields = {k: v for k, v in spec.items() if k != "name"}
    task: Task = TASKS.get(str(spec["name"]))(**fields)
    return task

"""Utility metrics: what a model is still good for (the cost side of a defense), beside the leakage metrics.

Image classifiers: top-1 accuracy. Text: the next-token NLL and accuracy behind perplexity (causal LMs), and
a sequence classifier's predictions, accuracy and macro-F1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from gradleak.data.text import TextBatch
from gradleak.device import module_device


@torch.no_grad()
def top1_accuracy(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1024
) -> float:
    """Top-1 accuracy in [0, 1], in eval mode; the model's mode is restored after (it was forced to train
    mode, which switched a caller's eval-mode model, e.g. an attack's, to batch statistics)."""
    was_training = model.training
    model.eval()
    correct, device = 0, module_device(model)
    for i in range(0, len(labels), batch_size):
        scores = model(images[i : i + batch_size].to(device)).argmax(1).cpu()
        correct += int((scores == labels[i : i + batch_size]).sum())
    model.train(was_training)
    return correct / max(1, len(labels))


@torch.no_grad()
def next_token_scores(model: nn.Module, batches: Iterable[TextBatch]) -> tuple[float, int, int]:
    """Over ``batches``: the summed next-token NLL (the model's mean loss times its next-token positions),
    how many of those positions the argmax predicts, and how many there are."""
    nll, hits, count, device = 0.0, 0, 0, module_device(model)
    for b in batches:
        b = b.to(device)
        labels = b.input_ids.masked_fill(b.attention_mask == 0, -100)
        out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=labels)
        keep = (b.attention_mask[:, 1:] * b.attention_mask[:, :-1]).bool()
        n = int(keep.sum())
        nll += float(out.loss) * n
        hits += int((out.logits[:, :-1].argmax(-1)[keep] == b.input_ids[:, 1:][keep]).sum())
        count += n
    return nll, hits, count


def perplexity(model: nn.Module, batches: Iterable[TextBatch]) -> float:
    """exp of the token-weighted mean next-token NLL over ``batches`` (causal LMs)."""
    model.eval()
    nll, _, count = next_token_scores(model, batches)
    if count == 0:
        raise ValueError("no next-token positions to score")
    return math.exp(nll / count)


def accuracy(pred: Sequence[int], true: Sequence[int]) -> float:
    if len(pred) != len(true) or not true:
        raise ValueError("pred and true must be non-empty and of equal length")
    return sum(int(p == t) for p, t in zip(pred, true, strict=True)) / len(true)


def macro_f1(pred: Sequence[int], true: Sequence[int]) -> float:
    """Unweighted mean over the classes present in ``true`` or ``pred`` of the per-class F1."""
    if len(pred) != len(true) or not true:
        raise ValueError("pred and true must be non-empty and of equal length")
    f1s = []
    for c in sorted(set(pred) | set(true)):
        tp = sum(1 for p, t in zip(pred, true, strict=True) if p == c and t == c)
        fp = sum(1 for p, t in zip(pred, true, strict=True) if p == c and t != c)
        fn = sum(1 for p, t in zip(pred, true, strict=True) if p != c and t == c)
        f1s.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return sum(f1s) / len(f1s)


@torch.no_grad()
def classify(model: nn.Module, batches: Iterable[TextBatch]) -> tuple[list[int], list[int]]:
    """Predicted and true labels of a sequence-classification model over labelled batches."""
    model.eval()
    pred: list[int] = []
    true: list[int] = []
    for b in batches:
        if b.labels is None:
            raise ValueError("classification batches need labels")
        on = b.to(module_device(model))
        logits = model(input_ids=on.input_ids, attention_mask=on.attention_mask).logits
        pred += logits.argmax(-1).tolist()
        true += b.labels.tolist()
    return pred, true

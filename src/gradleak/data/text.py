"""The text data sets of paper 002 in :data:`gradleak.registry.DATASETS` (modality ``text``).

Each entry loads the raw texts of one split (:mod:`gradleak.text.data`); the runner tokenizes them with the
experiment's model's tokenizer, truncated to ``data.options.max_tokens`` (:class:`TextDataConfig`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from gradleak.registry import DATASETS
from gradleak.text.data import (
    FPB_AGREEMENT,
    MAX_TOKENS,
    TextDataset,
    load_emotion,
    load_financial_phrasebank,
    load_rotten_tomatoes,
    load_wikitext2,
)


@dataclass(frozen=True)
class TextDataConfig:
    """``max_tokens``: each text is truncated to at most this many tokens (<= 64, paper 002's and DAGER's
    setting). ``constant_label``: give every text this class of a two-class (or larger) label set, so that
    a sequence classifier can train on a data set without labels (paper 002 does so on WikiText-2)."""

    max_tokens: int = MAX_TOKENS
    constant_label: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be an int in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if self.constant_label is not None and self.constant_label < 0:
            raise ValueError(f"constant_label must be >= 0, got {self.constant_label}")


def _labelled(data: TextDataset, config: TextDataConfig | None) -> TextDataset:
    if config is None or config.constant_label is None:
        return data
    c = config.constant_label
    names = tuple(f"label {i}" for i in range(max(2, c + 1)))
    return TextDataset(data.name, data.texts, (c,) * len(data), names)


Loader = Callable[..., TextDataset]


def _rotten_tomatoes(
    *, split: str = "all", root: str | os.PathLike[str] | None = None, limit: int | None = None,
    config: TextDataConfig | None = None,
) -> TextDataset:  # fmt: skip
    if split != "all":
        raise ValueError(
            f"rotten_tomatoes has one split, 'all' (the runner holds out a test share); got {split!r}"
        )
    return load_rotten_tomatoes(root, limit)


def _with_split(load: Callable[..., TextDataset], default: str) -> Loader:
    def loader(
        *, split: str = default, root: str | os.PathLike[str] | None = None, limit: int | None = None,
        config: TextDataConfig | None = None,
    ) -> TextDataset:  # fmt: skip
        return _labelled(load(split, root, limit), config)

    return loader


for name, loader, summary in (
    ("rotten_tomatoes", _rotten_tomatoes, "RT sentence polarity, 2 labels; split 'all'"),
    ("wikitext2", _with_split(load_wikitext2, "test"), "WikiText-2 paragraphs, no labels; split test/valid"),
    ("financial_phrasebank", _with_split(load_financial_phrasebank, "AllAgree"),
     f"Financial PhraseBank, 3 labels; split = agreement {'/'.join(FPB_AGREEMENT)}"),
    ("emotion", _with_split(load_emotion, "train"), "dair-ai Emotion, 6 labels; split train/val/test"),
):  # fmt: skip
    DATASETS.register(name, loader, config_cls=TextDataConfig, summary=summary, modality="text")

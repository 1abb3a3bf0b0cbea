"""Text data sets of paper 002 (Section VI-A): Rotten Tomatoes, WikiText-2, Financial PhraseBank, Emotion.

Each loader reads the offline copy under the data root (:func:`gradleak.data.root.resolve_data_root`) and
returns a :class:`TextDataset` of raw strings (and labels where the data set has them). Tokenization is
separate (:func:`encode`): sequences are truncated to at most ``MAX_TOKENS = 64`` tokens, the setting of
paper 002 and of DAGER, and right-padded with an attention mask. Splits are seeded permutations
(:func:`split`), drawn with an explicit ``torch.Generator``.

WikiText-2 has no labels; its examples are the non-empty, non-heading lines (paragraphs) of the tokenized
file, truncated at encoding time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradleak.data.root import check_limit, check_split, require_file, resolve_data_root
from gradleak.registry import DATASETS

MAX_TOKENS = 64
HOW_TO_GET = {
    "rotten_tomatoes": "Rotten Tomatoes sentence polarity v1.0 (rt-polaritydata.tar.gz) from "
    "https://www.cs.cornell.edu/people/pabo/movie-review-data/ into <root>/text/rotten_tomatoes/",
    "wikitext2": "WikiText-2 (tokenized, wikitext-2-v1.zip) from "
    "https://blog.salesforceairesearch.com/the-wikitext-long-term-dependency-language-modeling-dataset/ "
    "into <root>/text/wikitext-2/",
    "financial_phrasebank": "FinancialPhraseBank-v1.0 from "
    "https://www.researchgate.net/publication/251231364 into <root>/text/financial_phrasebank/",
    "emotion": "the dair-ai emotion split files (train/val/test, `text;label` lines) from "
    "https://github.com/dair-ai/emotion_dataset into <root>/text/emotion/",
}


@dataclass(frozen=True)
class TextDataset:
    """Raw sentences with optional integer labels; ``label_names[i]`` names label ``i``."""

    name: str
    texts: tuple[str, ...]
    labels: tuple[int, ...] | None = None
    label_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.labels is not None and len(self.labels) != len(self.texts):
            raise ValueError(f"{self.name}: {len(self.texts)} texts but {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def subset(self, indices: Sequence[int]) -> TextDataset:
        idx = [int(i) for i in indices]
        labels = None if self.labels is None else tuple(self.labels[i] for i in idx)
        return TextDataset(self.name, tuple(self.texts[i] for i in idx), labels, self.label_names)


def split(dataset: TextDataset, fractions: Sequence[float], *, seed: int) -> list[TextDataset]:
    """A seeded random partition into consecutive parts of the given fractions (summing to at most 1)."""
    if not fractions or any(f <= 0 for f in fractions) or sum(fractions) > 1 + 1e-9:
        raise ValueError(f"fractions must be positive and sum to <= 1, got {list(fractions)}")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    parts, start = [], 0
    for f in fractions:
        n = int(round(f * len(dataset)))
        parts.append(dataset.subset(order[start : start + n]))
        start += n
    return parts


def sample(dataset: TextDataset, n: int, *, seed: int) -> TextDataset:
    """``n`` examples drawn without replacement with a seeded generator."""
    if not 1 <= n <= len(dataset):
        raise ValueError(f"cannot draw {n} of {len(dataset)} examples")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:n]
    return dataset.subset(order.tolist())


def _lines(path: Path, encoding: str) -> list[str]:
    return [ln.strip() for ln in path.read_text(encoding=encoding).split("\n")]  # not splitlines: \x85 etc.


def _limit(ds: TextDataset, limit: int | None) -> TextDataset:
    return ds if limit is None else ds.subset(range(min(limit, len(ds))))


def load_rotten_tomatoes(root: str | os.PathLike[str] | None = None, limit: int | None = None) -> TextDataset:
    """5331 positive (label 1) then 5331 negative (label 0) sentences, latin-1 encoded."""
    check_limit(limit)
    base = resolve_data_root(root)
    texts: list[str] = []
    labels: list[int] = []
    for fname, label in (("rt-polarity.neg", 0), ("rt-polarity.pos", 1)):
        path = require_file(base, f"text/rotten_tomatoes/{fname}", HOW_TO_GET["rotten_tomatoes"])
        lines = [ln for ln in _lines(path, "latin-1") if ln]
        texts += lines
        labels += [label] * len(lines)
    ds = TextDataset("rotten_tomatoes", tuple(texts), tuple(labels), ("negative", "positive"))
    return _limit(ds, limit)


def load_wikitext2(
    split_name: str = "test", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> TextDataset:
    """Paragraph lines of wiki.{test,valid}.tokens (headings ``= ... =`` and blank lines dropped)."""
    check_split("wikitext2", split_name, ("test", "valid"), "the train split is not available offline")
    check_limit(limit)
    path = require_file(
        resolve_data_root(root), f"text/wikitext-2/wiki.{split_name}.tokens", HOW_TO_GET["wikitext2"]
    )
    texts = [ln for ln in _lines(path, "utf-8") if ln and not ln.startswith("=")]
    return _limit(TextDataset("wikitext2", tuple(texts)), limit)


FPB_LABELS = ("negative", "neutral", "positive")
FPB_AGREEMENT = ("AllAgree", "75Agree", "66Agree", "50Agree")


def load_financial_phrasebank(
    agreement: str = "AllAgree", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> TextDataset:
    """``sentence@label`` lines; AllAgree is utf-8, the others latin-1."""
    check_split("financial_phrasebank", agreement, FPB_AGREEMENT)
    check_limit(limit)
    path = require_file(
        resolve_data_root(root),
        f"text/financial_phrasebank/Sentences_{agreement}.txt",
        HOW_TO_GET["financial_phrasebank"],
    )
    encoding = "utf-8" if agreement == "AllAgree" else "latin-1"
    texts, labels = [], []
    for ln in _lines(path, encoding):
        if not ln:
            continue
        text, _, label = ln.rpartition("@")
        texts.append(text.strip())
        labels.append(FPB_LABELS.index(label.strip()))
    return _limit(TextDataset("financial_phrasebank", tuple(texts), tuple(labels), FPB_LABELS), limit)


EMOTION_LABELS = ("sadness", "joy", "love", "anger", "fear", "surprise")


def load_emotion(
    split_name: str = "train", root: str | os.PathLike[str] | None = None, limit: int | None = None
) -> TextDataset:
    """dair-ai Emotion: a header line, then ``text;label_name`` lines."""
    check_split("emotion", split_name, ("train", "val", "test"))
    check_limit(limit)
    path = require_file(resolve_data_root(root), f"text/emotion/{split_name}.txt", HOW_TO_GET["emotion"])
    texts, labels = [], []
    for ln in _lines(path, "utf-8")[1:]:
        if not ln:
            continue
        text, _, label = ln.rpartition(";")
        texts.append(text)
        labels.append(EMOTION_LABELS.index(label))
    return _limit(TextDataset("emotion", tuple(texts), tuple(labels), EMOTION_LABELS), limit)


def load_text_dataset(
    name: str,
    split: str | None = None,
    root: str | os.PathLike[str] | None = None,
    limit: int | None = None,
) -> TextDataset:
    """Load a registered text data set (``DATASETS`` entries of modality ``text``) by name: its raw texts."""
    entry = DATASETS.entry(name)
    if entry.modality != "text":
        raise ValueError(f"dataset {name!r} is not a text data set")
    kwargs: dict[str, Any] = {"root": root, "limit": limit}
    if split is not None:
        kwargs["split"] = split
    dataset = entry.factory(**kwargs)
    if not isinstance(dataset, TextDataset):
        raise TypeError(f"text data set {name!r}: its loader returned a {type(dataset).__name__}")
    return dataset


@dataclass(frozen=True)
class TextBatch:
    """Token ids ``(B, T)`` right-padded, ``attention_mask`` (1 = token), optional class ``labels`` (B,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.attention_mask.shape or self.input_ids.dim() != 2:
            raise ValueError("input_ids and attention_mask must both be (B, T)")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> TextBatch:
        """The same batch on ``device`` (itself when it is already there)."""
        if self.input_ids.device == torch.device(device):
            return self
        labels = self.labels.to(device) if self.labels is not None else None
        return TextBatch(self.input_ids.to(device), self.attention_mask.to(device), labels)

    def sequences(self) -> list[list[int]]:
        """The unpadded token ids of each sequence."""
        return [ids[m.bool()].tolist() for ids, m in zip(self.input_ids, self.attention_mask, strict=True)]


@dataclass(frozen=True)
class TokenDataset:
    """A tokenized text data set, the text clients' data (as :class:`~gradleak.data.base.ImageDataset` is
    the image clients'): ``input_ids`` / ``attention_mask`` ``(N, T)`` right-padded, class ``labels`` ``(N,)``
    int64 (None for language modelling), ``num_classes`` labels, ``groups`` as the image data's, ``pad_id``
    the id padded positions carry (GPT-2's sequence classifier finds a sequence's last token by it).

    :meth:`batch` is the :class:`TextBatch` a model takes, cut to its longest sequence: a batch's padding
    does not depend on which other sequences share its data set.
    """

    name: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor | None = None
    num_classes: int = 0
    groups: torch.Tensor | None = None
    pad_id: int = 0

    def __post_init__(self) -> None:
        TextBatch(self.input_ids, self.attention_mask, self.labels)  # the same shape checks
        n = int(self.input_ids.shape[0])
        if self.labels is not None and (self.labels.shape != (n,) or self.labels.dtype != torch.int64):
            raise ValueError(f"{self.name}: labels must be int64 of shape ({n},)")
        if n and bool((self.attention_mask.sum(1) == 0).any()):
            raise ValueError(f"{self.name}: every sequence needs at least one token")
        if self.groups is not None and self.groups.shape != (n,):
            raise ValueError(f"{self.name}: groups must be of shape ({n},)")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def inputs(self) -> torch.Tensor:
        """The model inputs (token ids), as ``ImageDataset.inputs`` gives the images."""
        return self.input_ids

    @property
    def input_shape(self) -> tuple[int]:
        return (int(self.input_ids.shape[1]),)

    def batch(self) -> TextBatch:
        width = int(self.attention_mask.sum(1).max()) if len(self) else 0
        return TextBatch(self.input_ids[:, :width], self.attention_mask[:, :width], self.labels)

    def subset(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> TokenDataset:
        idx = torch.as_tensor([int(i) for i in indices], dtype=torch.long)
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return TokenDataset(self.name, self.input_ids[idx], self.attention_mask[idx], pick(self.labels),
                            self.num_classes, pick(self.groups), self.pad_id)  # fmt: skip

    @staticmethod
    def concat(parts: Sequence[TokenDataset]) -> TokenDataset:
        """The data sets one after the other, padded to the widest (the data behind an aggregate)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        width = max(p.input_ids.shape[1] for p in parts)
        pad = parts[0].pad_id

        def widen(t: torch.Tensor, value: int) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        ids = torch.cat([widen(p.input_ids, pad) for p in parts])
        mask = torch.cat([widen(p.attention_mask, 0) for p in parts])
        labels = None if parts[0].labels is None else torch.cat([p.labels for p in parts])  # type: ignore[misc]
        return TokenDataset(parts[0].name, ids, mask, labels, parts[0].num_classes, pad_id=pad)

    @staticmethod
    def from_texts(dataset: TextDataset, tokenizer: Any, *, max_tokens: int = MAX_TOKENS) -> TokenDataset:
        """``dataset`` tokenized by :func:`encode` (truncated to ``max_tokens``, right-padded)."""
        batch = encode(list(dataset.texts), tokenizer, max_tokens=max_tokens, labels=dataset.labels)
        return TokenDataset(dataset.name, batch.input_ids, batch.attention_mask, batch.labels,
                            dataset.num_labels, pad_id=pad_id(tokenizer))  # fmt: skip


def pad_id(tokenizer: Any) -> int:
    """The id padded positions carry: the tokenizer's pad token, else its end-of-sequence token."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def encode(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    max_tokens: int = MAX_TOKENS,
    labels: Sequence[int] | None = None,
) -> TextBatch:
    """Tokenize, truncate to ``max_tokens`` (<= 64) and right-pad with the tokenizer's pad (else eos) id."""
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"max_tokens must be in [1, {MAX_TOKENS}], got {max_tokens}")
    seqs = [tokenizer(t, truncation=True, max_length=max_tokens)["input_ids"] for t in texts]
    seqs = [s[:max_tokens] for s in seqs]
    if any(len(s) == 0 for s in seqs):
        raise ValueError("a text encodes to zero tokens")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    lab = None if labels is None else torch.tensor(list(labels), dtype=torch.long)
    return TextBatch(ids, mask, lab)


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

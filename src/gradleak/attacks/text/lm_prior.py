"""A language-model prior for text attacks: a small GPT-2-arch model trained here on a public split.

LAMP (Balunović et al., NeurIPS 2022, Sec. 4.2) scores its discrete moves by the gradient distance plus
``coeff_perplexity`` times the perplexity loss of an auxiliary language model over the *victim's* token ids:
the official code (eth-sri/lamp, ``nlp_utils.load_gpt2_from_dict``) loads a GPT-2 (24 layers, 1024 wide)
trained on WikiText-103 with BERT's 30,522-token vocabulary, so ``lm(input_ids=ids, labels=ids).loss`` reads
the reconstruction's own ids. No such checkpoint exists offline. :func:`load_prior` builds a prior over
the victim's ids from a public split, each text encoded as the victim encodes it (special tokens included)
and the texts concatenated: by default smoothed token bigrams (counted in a second: the moves' swaps and
moved spans are local, which is what bigrams score), or the official kind of model, a GPT-2, smaller,
trained here (``kind="gpt2"``; minutes to hours on 2 cores, kept on disk with ``store``).

The default split is WikiText-2's ``valid``: the text benchmarks' clients hold WikiText-2 ``test`` and Rotten
Tomatoes, so the prior has seen none of their sentences. Training on the clients' own split would hand the
attack their data: :func:`load_prior` does not know what the clients hold, so the run's config must keep
the two apart (the docs say which prior each run used).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from gradleak.data.text import load_text_dataset
from gradleak.fileio import atomic_write
from gradleak.models.text import TOKENIZERS, load_tokenizer
from gradleak.progress import bar

log = logging.getLogger(__name__)

PRIOR_FORMAT = "gradleak-lm-prior-1"


@dataclass(frozen=True)
class LMPriorConfig:
    """The prior: ``tokenizer`` names the registered text model whose tokenizer the victim uses (None: no
    prior); ``kind`` ``"bigram"`` (Witten-Bell smoothed token bigrams counted on ``data``'s ``split``: no
    training, a second) or ``"gpt2"`` (``layers`` x ``width``, ``heads``, ``context`` positions, trained
    ``steps`` AdamW steps of ``batch_size`` windows at ``lr``, seeded by ``seed``: 0.5-1 s a step on 2 cores
    with a 30k vocabulary); ``store``: a folder to keep a trained GPT-2 prior in (None: memory only)."""

    tokenizer: str | None = None
    kind: str = "bigram"
    data: str = "wikitext2"
    split: str = "valid"
    layers: int = 2
    width: int = 256
    heads: int = 4
    context: int = 64
    steps: int = 1500
    batch_size: int = 32
    lr: float = 1e-3
    seed: int = 0
    store: str | None = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.tokenizer not in TOKENIZERS:
            raise ValueError(
                f"prior tokenizer must be a text model's, one of {sorted(TOKENIZERS)}, got {self.tokenizer!r}"
            )
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        for name in ("layers", "width", "heads", "context", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be a multiple of heads ({self.heads})")
        if self.context < 2:
            raise ValueError(f"context must be >= 2, got {self.context}")
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")

    @property
    def key(self) -> str:
        """The options that decide the trained weights (the store folder aside)."""
        fields = {k: v for k, v in asdict(self).items() if k != "store"}
        return json.dumps({"format": PRIOR_FORMAT, **fields}, sort_keys=True)


class LMPrior(Protocol):
    """A prior over the victim's token ids: :meth:`nll` is each sequence's mean next-token negative
    log-likelihood."""

    def nll(self, ids: torch.Tensor) -> torch.Tensor:
        """(n,) mean NLL of each row of ``ids`` (n, T)."""
        ...


class TransformerPrior:
    """A trained GPT-2-arch prior (the official code's kind of model, smaller)."""

    def __init__(self, model: nn.Module, context: int) -> None:
        self.model = model.eval()
        self.context = context

    @torch.no_grad()
    def nll(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.context:
            raise ValueError(f"the GPT-2 prior reads {self.context} tokens; a sequence holds {ids.shape[1]}")
        if ids.shape[1] < 2:
            return torch.zeros(ids.shape[0], device=ids.device)  # no next token to predict
        device = ids.device  # the prior stays where it was built (the CPU); the result goes back
        ids = ids.to(torch.long).to(next(self.model.parameters()).device)
        logits = self.model(input_ids=ids).logits[:, :-1]
        loss = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        return loss.mean(dim=1).to(device)


class BigramPrior:
    """Token bigrams with Witten-Bell smoothing (Witten and Bell 1991; Chen and Goodman 1999, Sec. 2.4):
    P(b | a) = (c(a, b) + t(a) P(b)) / (c(a) + t(a)), t(a) the number of distinct tokens seen after a and
    P(b) = (c(b) + 1) / (N + V) the add-one unigram; a token never seen before anything falls back to
    P(b)."""

    def __init__(self, stream: torch.Tensor, vocab_size: int) -> None:
        v = vocab_size
        pairs = stream[:-1] * v + stream[1:]
        self.keys, self.counts = torch.unique(pairs, return_counts=True)  # sorted keys
        firsts = self.keys // v
        self.after = torch.bincount(stream[:-1], minlength=v).double()  # c(a) as a history
        self.types = torch.bincount(firsts, minlength=v).double()  # t(a)
        self.unigram = (torch.bincount(stream, minlength=v).double() + 1) / (len(stream) + v)
        self.vocab_size = v

    @torch.no_grad()
    def nll(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] < 2:
            return torch.zeros(ids.shape[0], device=ids.device)  # no next token to predict
        device, ids = ids.device, ids.cpu().long()  # the counts live on the CPU; the result goes back
        a, b = ids[:, :-1], ids[:, 1:]
        keys = a * self.vocab_size + b
        at = torch.searchsorted(self.keys, keys).clamp_max(len(self.keys) - 1)
        pair = torch.where(self.keys[at] == keys, self.counts[at], torch.zeros_like(keys)).double()
        ca, ta = self.after[a], self.types[a]
        p = torch.where(ca > 0, (pair + ta * self.unigram[b]) / (ca + ta).clamp_min(1), self.unigram[b])
        return (-p.log()).mean(dim=1).float().to(device)


_MEMO: dict[tuple[str, str | None], LMPrior] = {}
MEMO_SIZE = 4  # priors kept in memory (a GPT-2 prior holds its weights)


def load_prior(config: LMPriorConfig) -> LMPrior:
    """The prior for ``config``: from memory, or built now (``kind``'s builder) and kept there (the last
    :data:`MEMO_SIZE`; a ``store`` is part of the key, so a prior asked for with one is saved there)."""
    if config.tokenizer is None:
        raise ValueError("LMPriorConfig.tokenizer is None: no prior was asked for")
    key = (config.key, config.store)
    if key not in _MEMO:
        if len(_MEMO) >= MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = KINDS[config.kind](config, vocabulary_size(config.tokenizer))
    return _MEMO[key]


@functools.cache
def vocabulary_size(tokenizer: str) -> int:
    """The number of tokens of a registered text model's tokenizer (loaded once per process)."""
    return len(load_tokenizer(tokenizer))


def clear_priors() -> None:
    """Forget the priors kept in memory (stored files stay)."""
    _MEMO.clear()


def _bigram(config: LMPriorConfig, vocab: int) -> LMPrior:
    return BigramPrior(token_stream(config), vocab)


def _gpt2(config: LMPriorConfig, vocab: int) -> LMPrior:
    """The GPT-2 prior from ``store``, or trained now (and saved there)."""
    file = _file(config)
    model = _build(config, vocab)
    if file is not None and file.is_file():
        _load_into(model, file, config)
        log.info("LM prior loaded from %s", file)
    else:
        _train(model, config)
        if file is not None:
            state = {
                k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
            }
            atomic_write(file, lambda tmp: save_file(state, str(tmp), metadata={"key": config.key}))
            log.info("LM prior saved to %s", file)
    return TransformerPrior(model, config.context)


KINDS: dict[str, Callable[[LMPriorConfig, int], LMPrior]] = {"bigram": _bigram, "gpt2": _gpt2}


def _file(config: LMPriorConfig) -> Path | None:
    if config.store is None:
        return None
    digest = hashlib.blake2b(config.key.encode(), digest_size=10).hexdigest()
    return Path(config.store) / f"lm-prior-{digest}.safetensors"


def _load_into(model: nn.Module, file: Path, config: LMPriorConfig) -> None:
    """The stored weights, checked before any is read: written for exactly these options, exactly this
    model's tensors (names, shapes, float32; the tied head left out), every value finite."""
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # the head is tied
    with safe_open(str(file), "pt") as f:
        key = (f.metadata() or {}).get("key")
        if key != config.key:
            raise ValueError(f"{file}: written for other options ({key!r}); remove it or change the store")
        names = set(f.keys())
        if names != set(want):
            raise ValueError(f"{file}: does not hold this prior's tensors ({sorted(names ^ set(want))[:5]})")
        for name in names:
            part = f.get_slice(name)
            if list(part.get_shape()) != list(want[name].shape) or part.get_dtype() != "F32":
                raise ValueError(f"{file}: {name} is {part.get_dtype()} {part.get_shape()}, not this prior's")
    state = load_file(str(file))
    bad = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"{file}: non-finite values in {bad[:5]}")
    model.load_state_dict(state, strict=False)


def _build(config: LMPriorConfig, vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt = GPT2Config(
        vocab_size=vocab, n_positions=config.context, n_embd=config.width, n_layer=config.layers,
        n_head=config.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # the CPU generator only: no accelerator's is touched
        torch.default_generator.manual_seed(config.seed)
        return GPT2LMHeadModel(gpt)


def token_stream(config: LMPriorConfig) -> torch.Tensor:
    """The public split's texts encoded as the victim encodes them, concatenated (1-D)."""
    assert config.tokenizer is not None
    tok = load_tokenizer(config.tokenizer)
    texts = load_text_dataset(config.data, split=config.split).texts
    ids = [i for text in texts for i in tok(text, verbose=False)["input_ids"]]
    return torch.tensor(ids, dtype=torch.long)


def _train(model: nn.Module, config: LMPriorConfig) -> None:
    stream = token_stream(config)
    windows = stream[: len(stream) // config.context * config.context].view(-1, config.context)
    if len(windows) < config.batch_size:
        raise ValueError(
            f"{config.data}/{config.split} holds {len(windows)} windows of {config.context} tokens, fewer "
            f"than a batch of {config.batch_size}"
        )
    gen = torch.Generator().manual_seed(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=config.lr, total_steps=config.steps, pct_start=0.1
    )
    model.train()
    for _ in bar(range(config.steps), desc="LM prior training"):
        batch = windows[torch.randint(len(windows), (config.batch_size,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    log.info("LM prior trained: %d steps, last batch loss %.3f", config.steps, float(loss.detach()))

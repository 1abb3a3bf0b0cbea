"""The model (a causal LM with LoRA adapters on its attention, the same seeded adapters on every node), the
nodes' data (IID shares of Rotten Tomatoes) and local training (plain SGD on the adapters).

Only the trainable parameters travel: :func:`adapter_arrays` is what a node sends and the server aggregates,
as FlowerTune's apps send only their adapters; the frozen base stays where it was loaded.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from gradleak.data.text import TextDataset, TokenDataset, load_text_dataset
from gradleak.models.adapters import AdapterConfig, apply_adapter
from gradleak.models.text import TextModel, build_text_model
from gradleak.validation import trainable_of


@functools.lru_cache(maxsize=2)
def _base(name: str) -> TextModel:
    return build_text_model(name, "causal_lm", seed=0)


def build(name: str, r: int, alpha: int) -> tuple[nn.Module, object]:
    """A fresh copy of the adapted model (LoRA on the attention, seeded: the same on server and nodes) and
    its tokenizer."""
    tm = _base(name)
    model = apply_adapter(copy.deepcopy(tm.model), AdapterConfig(r=r, alpha=alpha, target=["attention"]),
                          "causal_lm", seed=0)  # fmt: skip
    return model, tm.tokenizer


def adapter_arrays(model: nn.Module) -> dict[str, torch.Tensor]:
    """The arrays a round exchanges: the trainable parameters (the adapters), by their state_dict names."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in trainable_of(model)}


def load_adapters(model: nn.Module, arrays: dict[str, torch.Tensor]) -> None:
    """Put received adapters into ``model`` (every trainable parameter, nothing else)."""
    if set(arrays) != set(trainable_of(model)):
        raise ValueError("the arrays received are not this model's adapters")
    model.load_state_dict({**model.state_dict(), **arrays}, strict=True)


def node_data(partition_id: int, num_partitions: int, dataset_size: int, tokenizer: object,
              max_tokens: int) -> TokenDataset:  # fmt: skip
    """Node ``partition_id``'s IID share of the first ``dataset_size`` sentences."""
    texts = load_text_dataset("rotten_tomatoes", split="all").texts[:dataset_size]
    share = [texts[i] for i in range(partition_id, len(texts), num_partitions)]
    data = TextDataset("rotten_tomatoes", tuple(share), None, ())
    return TokenDataset.from_texts(data, tokenizer, max_tokens=max_tokens)


def train(model: nn.Module, data: TokenDataset, epochs: int, batch_size: int, lr: float) -> float:
    """SGD on the adapters over the node's sentences in order (the causal-LM loss; padding ignored); the
    mean loss."""
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    total, steps = 0.0, 0
    for _ in range(epochs):
        for start in range(0, len(data), batch_size):
            batch = data.subset(range(start, min(start + batch_size, len(data)))).batch()
            labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
            loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + float(loss), steps + 1
    model.eval()
    return total / max(steps, 1)

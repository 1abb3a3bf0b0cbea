"""Model surgery for malicious-server attacks: an imprint (linear-leakage) block in front of a classifier.

The block follows Fowl et al., "Robbing the Fed: Directly Obtaining Private Data in Federated Learning with
Modified Models" (ICLR 2022), Sec. 3: a linear layer of ``k`` bins measures the (optionally transformed)
input, a ReLU makes the bins cumulative, and a *back-connection* feeds the bins into the rest of the network
so that they receive gradient::

    f = front(x)                      (flatten; LOKI: per-client 1x1 conv + flatten; Scale-MIA: encoder)
    h = ReLU(W f + b)                 (N, k): bin i fires for every sample whose measurement exceeds its cut
    x' = x + beta * mean_i(h_i)       (the same scalar added to every pixel of the sample)
    y  = classifier(x')

``beta`` is a fixed buffer, identical for every bin, so dL/dh_{n,i} = beta / k * sum(dL/dx'_n) is the same
for all bins sample ``n`` activates; that is what makes differences of consecutive bins isolate samples.
With a small ``beta * h`` the classifier sees (almost) its usual input, so local training stays stable.

:func:`insert_imprint` wraps any registered classifier without touching its parameters; the wrapped model is
an ordinary ``nn.Module`` the client trains unchanged (:func:`gradleak.fl.client.train_client`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

IMPRINT_PREFIX = "imprint"
"""Attribute of the block in :class:`MaliciousModel`; its parameters are ``imprint.linear.weight`` etc."""


class ImprintBlock(nn.Module):
    """``x -> x + beta * mean(ReLU(linear(front(x))))`` (see the module docstring)."""

    def __init__(
        self,
        feature_dim: int,
        num_bins: int,
        *,
        front: nn.Module | None = None,
        back_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        if feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {feature_dim}")
        self.front: nn.Module = front if front is not None else nn.Flatten()
        self.linear = nn.Linear(feature_dim, num_bins)
        self.back_weight: torch.Tensor
        self.register_buffer("back_weight", torch.tensor(float(back_weight)))

    @property
    def num_bins(self) -> int:
        return int(self.linear.out_features)

    def bins(self, x: torch.Tensor) -> torch.Tensor:
        """The bin activations ``ReLU(W front(x) + b)``, ``(N, k)``."""
        return F.relu(self.linear(self.front(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = self.back_weight * self.bins(x).mean(dim=1)
        return x + shift.view(-1, *([1] * (x.dim() - 1)))


class MaliciousModel(nn.Module):
    """``body(imprint(x))``: the server's broadcast model; ``body`` is the honest classifier, unchanged."""

    def __init__(self, imprint: ImprintBlock, body: nn.Module) -> None:
        super().__init__()
        self.imprint = imprint
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.imprint(x))


def insert_imprint(model: nn.Module, block: ImprintBlock) -> MaliciousModel:
    """A new :class:`MaliciousModel`: ``block`` in front of a copy of ``model`` (``model`` is untouched)."""
    return MaliciousModel(block, copy.deepcopy(model))


def imprint_parameter_names(prefix: str = IMPRINT_PREFIX) -> tuple[str, str]:
    """The names under which the imprint layer's weight and bias appear in updates."""
    return f"{prefix}.linear.weight", f"{prefix}.linear.bias"


def find_imprint(model: nn.Module) -> tuple[str, ImprintBlock]:
    """The (only) :class:`ImprintBlock` inside ``model`` and its module path; ``LookupError`` if none/many."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, ImprintBlock)]
    if len(found) != 1:
        raise LookupError(f"expected exactly one ImprintBlock in the model, found {len(found)}")
    return found[0]


__all__ = [
    "IMPRINT_PREFIX",
    "ImprintBlock",
    "MaliciousModel",
    "find_imprint",
    "imprint_parameter_names",
    "insert_imprint",
]

"""Model surgery for malicious-server attacks: an imprint (linear-leakage) block in front of a classifier.

The block follows Fowl et al., "Robbing the Fed: Directly Obtaining Private Data in Federated Learning with
Modified Models" (ICLR 2022), the imprint module: a linear layer of ``k`` bins measures the (optionally
transformed) input, a ReLU makes the bins cumulative, and a *back-connection* feeds the bins into the rest of
the network so that they receive gradient::

    f = front(x) - offset             (flatten; LOKI: per-client 1x1 conv + flatten; Scale-MIA: encoder;
                                       offset: a fixed centring, the public mean, which keeps bins steady)
    h = ReLU(W f + b)                 (N, k): bin i fires for every sample whose measurement exceeds its cut
    x' = x + beta * mean_i(h_i)       (the same scalar added to every pixel of the sample)
    y  = classifier(x')

``beta`` is a fixed buffer, identical for every bin, so dL/dh_{n,i} = beta / k * sum(dL/dx'_n) is the same
for all bins sample ``n`` activates; that is what makes differences of consecutive bins isolate samples.
With a small ``beta * h`` the classifier sees (almost) its usual input, so local training stays stable.

:func:`insert_imprint` wraps any registered classifier without touching its parameters; the wrapped model is
an ordinary ``nn.Module`` the client trains unchanged (:func:`gradleak.tasks.client.train_client`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

CLOSED_BIAS = -1.0e4
"""Bias of a LOKI slot that is closed for this client: its bins never fire, so its rows stay exactly zero."""

IMPRINT_PREFIX = "imprint"
"""Attribute of the block in :class:`MaliciousModel`; its parameters are ``imprint.linear.weight`` etc."""


class GroupedLinear(nn.Module):
    """``groups`` independent linear maps side by side: input ``(N, groups * D)``, output ``(N, groups * k)``.

    Row block ``j`` (rows ``j*k .. (j+1)*k - 1`` of ``weight``, shape ``(groups * k, D)``) reads only input
    block ``j``. It is the block-diagonal fully connected layer of LOKI (Zhao et al., IEEE S&P 2024) without
    storing the zero blocks; the zeros are structural, so training cannot fill them.
    """

    def __init__(self, in_features: int, out_features_per_group: int, groups: int) -> None:
        super().__init__()
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        self.groups = groups
        self.in_features = in_features
        self.out_features = out_features_per_group * groups
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(self.out_features))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, d = self.groups, self.in_features
        w = self.weight.view(g, -1, d)
        return torch.einsum("ngd,gkd->ngk", x.reshape(-1, g, d), w).reshape(len(x), -1) + self.bias


class SlotSeparator(nn.Module):
    """LOKI's per-client convolution: a bias-free 1x1 conv from ``C`` to ``slots * C`` channels, flattened.

    The server sends client ``j`` the kernels of slot ``j`` set to the identity and every other slot's
    kernels set to zero (:func:`select_slot`), so the client's data reach only slot ``j``'s imprint rows
    (whose biases it also sets to :data:`CLOSED_BIAS` for the other slots, so that centred bins of an empty
    slot cannot fire either).
    """

    def __init__(self, channels: int, slots: int) -> None:
        super().__init__()
        self.channels = channels
        self.slots = slots
        self.conv = nn.Conv2d(channels, slots * channels, kernel_size=1, bias=False)
        self.open_slots(range(slots))

    @torch.no_grad()
    def open_slots(self, slots: range | list[int]) -> None:
        """Identity kernels for ``slots``, zero for the others."""
        self.conv.weight.zero_()
        for s in slots:
            if not 0 <= s < self.slots:
                raise ValueError(f"slot {s} outside [0, {self.slots})")
            for c in range(self.channels):
                self.conv.weight[s * self.channels + c, c, 0, 0] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).flatten(1)


class ImprintBlock(nn.Module):
    """``x -> x + beta * mean(ReLU(linear(front(x))))`` (see the module docstring)."""

    def __init__(
        self,
        feature_dim: int,
        num_bins: int,
        *,
        front: nn.Module | None = None,
        back_weight: float = 1.0,
        offset: torch.Tensor | None = None,
        groups: int = 1,
    ) -> None:
        super().__init__()
        if num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {num_bins}")
        if feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1, got {feature_dim}")
        self.front: nn.Module = front if front is not None else nn.Flatten()
        self.linear: nn.Linear | GroupedLinear = (
            nn.Linear(feature_dim, num_bins) if groups == 1 else GroupedLinear(feature_dim, num_bins, groups)
        )
        self.back_weight: torch.Tensor
        self.register_buffer("back_weight", torch.tensor(float(back_weight)))
        self.offset: torch.Tensor
        width = feature_dim * groups
        off = torch.zeros(width) if offset is None else offset.detach().reshape(-1).to(torch.float32)
        if off.numel() != width:
            raise ValueError(f"offset has {off.numel()} values, the imprint layer reads {width}")
        self.register_buffer("offset", off.clone())
        self.open_bias: torch.Tensor  # the programmed biases; LOKI's customisation closes other slots
        self.register_buffer("open_bias", torch.zeros(self.linear.out_features))

    @torch.no_grad()
    def remember_bias(self) -> None:
        """Keep the programmed biases, so that :func:`select_slot` can reopen any slot later."""
        self.open_bias.copy_(self.linear.bias)

    @property
    def num_bins(self) -> int:
        return int(self.linear.out_features)

    def bins(self, x: torch.Tensor) -> torch.Tensor:
        """The bin activations ``ReLU(W (front(x) - offset) + b)``, ``(N, k)``."""
        return F.relu(self.linear(self.front(x) - self.offset))

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


def select_slot(model: nn.Module, slot: int) -> nn.Module:
    """A copy of a LOKI broadcast customised for the client in ``slot`` (same parameter names and shapes):
    identity kernels and programmed biases for ``slot``, zero kernels and closed biases elsewhere."""
    custom = copy.deepcopy(model)
    _, block = find_imprint(custom)
    if not isinstance(block.front, SlotSeparator) or not isinstance(block.linear, GroupedLinear):
        raise LookupError("the imprint block has no per-client slots (SlotSeparator + GroupedLinear)")
    block.front.open_slots([slot])
    k = block.linear.out_features // block.linear.groups
    with torch.no_grad():
        block.linear.bias.fill_(CLOSED_BIAS)
        block.linear.bias[slot * k : (slot + 1) * k] = block.open_bias[slot * k : (slot + 1) * k]
    return custom


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
    "CLOSED_BIAS",
    "IMPRINT_PREFIX",
    "GroupedLinear",
    "ImprintBlock",
    "SlotSeparator",
    "MaliciousModel",
    "find_imprint",
    "imprint_parameter_names",
    "insert_imprint",
    "select_slot",
]

"""The app's own code, shaped as Flower's PyTorch quickstart: the model, each node's data, training, testing.

Nothing here calls gradleak's audit or defenses. One choice matters to an audit: the model normalises its
input inside ``forward`` (mean and std as non-persistent buffers, so the state_dict Flower sends is
unchanged) and the data pipeline yields pixels in [0, 1], the range in which an attack rebuilds images and
metrics score them. A model that relies on ``Normalize`` in the data pipeline is refused by the audit's
pre-flight check instead of being mis-scored. The data come from gradleak's offline CIFAR-10 reader, in
place of ``flwr-datasets`` (which downloads).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from gradleak.data import load_dataset

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's per-channel statistics


class Net(nn.Module):
    """Flower quickstart's CNN (two convolutions, three linear layers) with a BatchNorm after each
    convolution; normalises its [0, 1] input first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1), persistent=False)
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 5), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / self.std
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        x = x.flatten(1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


SERVER_SHARE = 500  # of the 2,000 images read: the server's held-out test set, never a node's


@functools.lru_cache(maxsize=1)
def _cifar10() -> TensorDataset:
    data = load_dataset("cifar10", "test", None, 2000)  # 200 of each class, pixels in [0, 1]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    return TensorDataset(data.images[order], data.labels[order])


def load_data(
    partition_id: int, num_partitions: int, batch_size: int, dataset_size: int
) -> tuple[DataLoader, DataLoader]:
    """Node ``partition_id``'s IID share of the nodes' ``dataset_size`` images: 80 % to train on, 20 % to
    test."""
    if not 0 < dataset_size <= 2000 - SERVER_SHARE:
        raise ValueError(f"dataset-size must be in [1, {2000 - SERVER_SHARE}], got {dataset_size}")
    share = torch.arange(partition_id, dataset_size, num_partitions).tolist()
    cut = int(0.8 * len(share))
    train, test = Subset(_cifar10(), share[:cut]), Subset(_cifar10(), share[cut:])
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size=batch_size)


def load_centralized_dataset() -> DataLoader:
    """The server's own held-out test set (disjoint from every node's data)."""
    return DataLoader(Subset(_cifar10(), range(2000 - SERVER_SHARE, 2000)), batch_size=128)


def train(net: Net, loader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """Local training (SGD with momentum 0.9); the mean training loss."""
    net.to(device).train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    total, steps = 0.0, 0
    for _ in range(epochs):
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
    return total / max(steps, 1)


def test(net: Net, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """The mean loss and the accuracy on ``loader``."""
    net.to(device).eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in loader:
            out = net(images.to(device))
            loss += F.cross_entropy(out, labels.to(device), reduction="sum").item()
            correct += int((out.argmax(1) == labels.to(device)).sum())
            n += len(labels)
    return loss / max(n, 1), correct / max(n, 1)

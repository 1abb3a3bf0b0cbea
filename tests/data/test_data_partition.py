"""Partitioners: disjoint cover, class limits, non-empty clients, determinism, skew, natural writers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from gradleak.data import (
    ImageDataset,
    dirichlet,
    iid,
    label_skew,
    load_dataset,
    natural,
    partition,
    partition_options,
)


def _labels(num_classes: int = 10, per_class: int = 500, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def _assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "a sample is in two clients or in none"
    assert np.array_equal(np.sort(allidx), np.arange(n))
    assert all(len(p) > 0 for p in parts)


def _mean_classes(parts: list[np.ndarray], y: np.ndarray) -> float:
    return float(np.mean([len(np.unique(y[p])) for p in parts]))


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, z) for x, z in zip(a, b, strict=True))


def test_iid() -> None:
    parts = iid(1003, 10, 0)
    _assert_disjoint_cover(parts, 1003)
    assert {len(p) for p in parts} == {100, 101}
    assert _same(parts, iid(1003, 10, np.random.default_rng(0)))
    assert not _same(parts, iid(1003, 10, 1))
    with pytest.raises(ValueError, match="num_clients"):
        iid(5, 10, 0)


@pytest.mark.parametrize(("num_clients", "k"), [(100, 5), (10, 1), (7, 3), (3, 4), (20, 10), (4, 20)])
def test_label_skew_invariants(num_clients: int, k: int) -> None:
    y = _labels()
    parts = label_skew(y, num_clients, k, rng=42)
    assert len(parts) == num_clients
    _assert_disjoint_cover(parts, len(y))
    assert max(len(np.unique(y[p])) for p in parts) <= k


def test_label_skew_paper_setting_on_real_labels() -> None:
    ds = load_dataset("organamnist", "train")  # 11 classes, imbalanced
    parts = label_skew(ds.labels, 100, 5, rng=0)  # torch labels accepted
    y = ds.labels.numpy()
    _assert_disjoint_cover(parts, len(y))
    assert [len(np.unique(y[p])) for p in parts] == [5] * 100
    assert len({tuple(np.unique(y[p])) for p in parts}) > 10  # class sets vary across clients


def test_label_skew_deterministic() -> None:
    y = _labels()
    assert _same(label_skew(y, 100, 5, 7), label_skew(y, 100, 5, 7))
    assert not _same(label_skew(y, 100, 5, 7), label_skew(y, 100, 5, 8))


@pytest.mark.parametrize(
    ("num_clients", "k", "match"),
    [(10, 0, "max_classes_per_client"), (0, 2, "num_clients"), (3, 2, "cover"), (10**5, 5, "num_clients")],
)
def test_label_skew_validation(num_clients: int, k: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        label_skew(_labels(), num_clients, k, 0)


def test_label_skew_too_few_samples_per_class() -> None:
    y = np.array([0] * 50 + [1])  # class 1 has one sample but would be held by many clients
    with pytest.raises(ValueError, match="empty"):
        label_skew(y, 20, 1, 0, max_attempts=3)


def test_dirichlet_invariants_and_determinism() -> None:
    y = _labels()
    parts = dirichlet(y, 20, 0.5, 3, min_size=10)
    _assert_disjoint_cover(parts, len(y))
    assert min(len(p) for p in parts) >= 10
    assert _same(parts, dirichlet(y, 20, 0.5, 3, min_size=10))
    assert not _same(parts, dirichlet(y, 20, 0.5, 4, min_size=10))
    _assert_disjoint_cover(dirichlet(torch.as_tensor(y), 20, 0.5, 3, balance=False), len(y))


def test_dirichlet_small_alpha_is_more_skewed() -> None:
    y = _labels()
    for seed in range(3):
        skewed = _mean_classes(dirichlet(y, 20, 0.05, seed), y)
        mild = _mean_classes(dirichlet(y, 20, 100.0, seed), y)
        assert skewed < 4.0 < 9.5 < mild


def test_dirichlet_errors() -> None:
    y = _labels()
    with pytest.raises(ValueError, match="alpha"):
        dirichlet(y, 10, 0.0, 0)
    with pytest.raises(ValueError, match="min_size"):
        dirichlet(y, 10, 1.0, 0, min_size=10**4)
    with pytest.raises(ValueError, match="could not give"):
        dirichlet(y, 100, 0.001, 0, min_size=1, max_attempts=5)


def test_natural_on_femnist_writers() -> None:
    ds = load_dataset("femnist", "train")
    assert ds.groups is not None
    g = ds.groups.numpy()
    parts = natural(ds.groups)
    assert len(parts) == 16
    _assert_disjoint_cover(parts, len(ds))
    for writer, p in enumerate(parts):
        assert set(g[p].tolist()) == {writer}
        assert len(p) == int((g == writer).sum())
    first = natural(g, 5)
    assert _same(first, parts[:5])
    rand = natural(g, 5, rng=1, pick="random")
    assert _same(rand, natural(g, 5, rng=1, pick="random"))
    assert all(len(set(g[p].tolist())) == 1 for p in rand)
    with pytest.raises(ValueError, match="only 16 groups"):
        natural(g, 17)
    with pytest.raises(ValueError, match="rng"):
        natural(g, 3, pick="random")


def _toy(n: int = 600, with_groups: bool = False) -> ImageDataset:
    y = torch.as_tensor(_labels(6, n // 6))
    groups = torch.arange(n) % 12 if with_groups else None
    return ImageDataset("toy", torch.zeros(n, 1, 2, 2), y, 6, groups)


def test_partition_by_name() -> None:
    ds = _toy(with_groups=True)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("iid", {}),
        ("label_skew", {"max_classes_per_client": 2}),
        ("dirichlet", {"alpha": 1.0}),
    ]
    for name, opts in cases:
        parts = partition(name, ds, 12, seed=5, **opts)
        _assert_disjoint_cover(parts, len(ds))
        assert _same(parts, partition(name, ds, 12, seed=5, **opts))
    assert len(partition("natural", ds, None, seed=0)) == 12
    assert partition_options("label_skew") == {"max_classes_per_client": 5}
    assert set(partition_options("dirichlet")) == {"alpha", "min_size", "balance"}


def test_partition_rejects_bad_input() -> None:
    ds = _toy()
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['k'\].*max_classes_per_client"):
        partition("label_skew", ds, 10, seed=0, k=2)
    with pytest.raises(ValueError, match="known"):
        partition("shards", ds, 10, seed=0)
    with pytest.raises(ValueError, match="groups"):
        partition("natural", ds, None, seed=0)
    with pytest.raises(ValueError, match="num_clients"):
        partition("iid", ds, None, seed=0)


def test_natural_keeps_only_groups_of_min_size() -> None:
    g = np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3])
    parts = natural(g, min_size=3)
    assert _same(parts, [np.array([0, 1, 2]), np.array([6, 7, 8, 9])])
    assert _same(natural(g, 1, min_size=2), [np.array([0, 1, 2])])
    with pytest.raises(ValueError, match="only 2 groups with >= 3 samples"):
        natural(g, 3, min_size=3)
    with pytest.raises(ValueError, match="min_size"):
        natural(g, min_size=0)

"""Loaders against the real offline data in ../shared/data (shapes, label counts, raw pixel spot-checks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gradleak.data import DataFileMissingError, ImageDataset, load_dataset, resolve_data_root
from gradleak.data import root as root_mod
from gradleak.data.cifar import CIFAR10_CLASSES
from gradleak.data.femnist import shard_files, writer_ids
from gradleak.registry import DATASETS, UnknownNameError


@pytest.fixture(scope="module")
def data_root() -> Path:
    root = resolve_data_root()
    assert (root / "medmnist").is_dir(), f"offline data not found at {root}"
    return root


@pytest.fixture(scope="module")
def cifar(data_root: Path) -> ImageDataset:
    return load_dataset("cifar10", "test", root=data_root)


def _check_basic(ds: ImageDataset, n: int, num_classes: int, shape: tuple[int, int, int]) -> None:
    assert len(ds) == n
    assert ds.input_shape == shape
    assert ds.images.dtype == torch.float32 and ds.labels.dtype == torch.int64
    assert ds.num_classes == num_classes
    assert float(ds.images.min()) >= 0.0 and float(ds.images.max()) <= 1.0
    assert int(ds.labels.min()) >= 0 and int(ds.labels.max()) < num_classes


@pytest.mark.parametrize(
    ("name", "split", "n", "num_classes", "shape"),
    [
        ("organamnist", "train", 34561, 11, (1, 28, 28)),
        ("organamnist", "val", 6491, 11, (1, 28, 28)),
        ("organamnist", "test", 17778, 11, (1, 28, 28)),
        ("pneumoniamnist", "train", 3882, 2, (1, 28, 28)),
        ("pneumoniamnist", "val", 524, 2, (1, 28, 28)),
        ("pneumoniamnist", "test", 624, 2, (1, 28, 28)),
        ("pathmnist", "test", 718, 9, (3, 28, 28)),
    ],
)
def test_medmnist_shapes_and_classes(
    data_root: Path, name: str, split: str, n: int, num_classes: int, shape: tuple[int, int, int]
) -> None:
    ds = load_dataset(name, split, root=data_root)
    _check_basic(ds, n, num_classes, shape)
    assert torch.unique(ds.labels).numel() == num_classes  # every class present
    assert ds.groups is None


@pytest.mark.parametrize(
    ("name", "relpath", "split", "index"),
    [
        ("organamnist", "medmnist/organamnist.npz", "val", 1234),
        ("pathmnist", "medmnist/pathmnist_test_subset.npz", "test", 321),
        ("pneumoniamnist", "medmnist/pneumoniamnist.npz", "test", 17),
    ],
)
def test_medmnist_pixels_match_raw_npz(
    data_root: Path, name: str, relpath: str, split: str, index: int
) -> None:
    with np.load(data_root / relpath) as npz:
        raw_img, raw_lab = npz[f"{split}_images"][index], npz[f"{split}_labels"][index]
    ds = load_dataset(name, split, root=data_root, limit=index + 1)
    assert len(ds) == index + 1
    raw_chw = raw_img[None] if raw_img.ndim == 2 else raw_img.transpose(2, 0, 1)
    np.testing.assert_allclose(
        ds.images[index].numpy(), raw_chw.astype(np.float32) / 255.0, rtol=0, atol=1e-7
    )
    assert int(ds.labels[index]) == int(raw_lab[0])
    if raw_img.ndim == 3:  # RGB: channel 1 at (5, 9) is the raw HWC value [5, 9, 1]
        assert float(ds.images[index, 1, 5, 9]) == pytest.approx(raw_img[5, 9, 1] / 255.0)


def test_pathmnist_only_test_subset(data_root: Path) -> None:
    with pytest.raises(ValueError, match="only.*test"):
        load_dataset("pathmnist", "train", root=data_root)
    assert len(load_dataset("pathmnist", root=data_root, limit=5)) == 5  # default split is "test"


@pytest.mark.parametrize("name", ["organamnist", "pneumoniamnist", "femnist", "cifar10"])
def test_bad_split_names_valid_splits(data_root: Path, name: str) -> None:
    with pytest.raises(ValueError, match="valid splits") as info:
        load_dataset(name, "training", root=data_root)
    assert "'test'" in str(info.value)


@pytest.mark.parametrize("limit", [0, -3, 2.5])
def test_bad_limit(data_root: Path, limit: object) -> None:
    with pytest.raises(ValueError, match="limit"):
        load_dataset("pneumoniamnist", "val", root=data_root, limit=limit)  # type: ignore[arg-type]


def test_cifar10_full(cifar: ImageDataset, data_root: Path) -> None:
    _check_basic(cifar, 10000, 10, (3, 32, 32))
    assert torch.bincount(cifar.labels, minlength=10).tolist() == [1000] * 10
    # class order, then file name: cat/0123.jpg is sample 3 * 1000 + 123
    with Image.open(data_root / "cifar10-test-jpeg" / "cat" / "0123.jpg") as img:
        raw = np.asarray(img.convert("RGB"))
    idx = CIFAR10_CLASSES.index("cat") * 1000 + 123
    assert int(cifar.labels[idx]) == 3
    np.testing.assert_allclose(cifar.images[idx].numpy(), raw.transpose(2, 0, 1) / 255.0, atol=1e-6)
    with pytest.raises(ValueError, match="only the CIFAR-10 test set"):
        load_dataset("cifar10", "train", root=data_root)


def test_cifar10_limit_is_class_balanced(cifar: ImageDataset, data_root: Path) -> None:
    small = load_dataset("cifar10", root=data_root, limit=25)
    counts = torch.bincount(small.labels, minlength=10).tolist()
    assert counts == [3, 3, 3, 3, 3, 2, 2, 2, 2, 2]
    # the first k files of each class, identical to the full decode
    full_idx = [c * 1000 + i for c, k in enumerate(counts) for i in range(k)]
    assert torch.equal(small.images, cifar.images[full_idx])
    assert torch.equal(small.labels, cifar.labels[full_idx])
    assert torch.bincount(load_dataset("cifar10", root=data_root, limit=10).labels).tolist() == [1] * 10


@pytest.mark.parametrize(("split", "n", "writers"), [("train", 2328, 16), ("test", 4088, 184)])
def test_femnist_counts(data_root: Path, split: str, n: int, writers: int) -> None:
    ds = load_dataset("femnist", split, root=data_root)
    _check_basic(ds, n, 62, (1, 28, 28))
    assert ds.groups is not None and ds.groups.dtype == torch.int64
    assert torch.unique(ds.groups).tolist() == list(range(writers))
    assert len(writer_ids(split, root=data_root)) == writers
    # LEAF stores dark ink on a white background: most pixels are exactly 1.0
    assert float((ds.images == 1.0).float().mean()) > 0.7


def test_femnist_matches_raw_json_and_writer_order(data_root: Path) -> None:
    ds = load_dataset("femnist", "train", root=data_root)
    assert ds.groups is not None
    first_shard = shard_files(data_root, "train")[0]
    assert first_shard.name.startswith("all_data_0_")
    shard = json.loads(first_shard.read_text(encoding="utf-8"))
    user = shard["users"][1]  # second writer of the first shard -> groups == 1
    raw = shard["user_data"][user]
    mine = (ds.groups == 1).nonzero().flatten()
    assert writer_ids("train", root=data_root)[1] == user
    assert len(mine) == len(raw["y"])
    assert ds.labels[mine].tolist() == raw["y"]
    np.testing.assert_allclose(ds.images[mine[3], 0].numpy().ravel(), np.asarray(raw["x"][3], np.float32))
    limited = load_dataset("femnist", "train", root=data_root, limit=50)
    assert len(limited) == 50 and torch.equal(limited.images, ds.images[:50])
    assert limited.groups is not None and torch.equal(limited.groups, ds.groups[:50])


@pytest.mark.parametrize(
    ("name", "split", "missing"),
    [
        ("organamnist", "train", "organamnist.npz"),
        ("pathmnist", "test", "pathmnist_test_subset.npz"),
        ("cifar10", "test", "cifar10-test-jpeg"),
        ("femnist", "test", "femnist-leaf"),
    ],
)
def test_missing_file_names_it(tmp_path: Path, name: str, split: str, missing: str) -> None:
    with pytest.raises(DataFileMissingError) as info:
        load_dataset(name, split, root=tmp_path)
    msg = str(info.value)
    assert missing in msg and str(tmp_path) in msg
    assert "http" in msg  # says where to get it
    assert isinstance(info.value, FileNotFoundError)


def test_explicit_root_must_exist(tmp_path: Path) -> None:
    gone = tmp_path / "nope"
    with pytest.raises(DataFileMissingError, match="nope"):
        resolve_data_root(gone)


def test_env_var_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_root: Path) -> None:
    monkeypatch.setenv("GRADLEAK_DATA", str(tmp_path))
    assert resolve_data_root() == tmp_path.resolve()
    assert resolve_data_root(data_root) == data_root  # explicit beats env
    with pytest.raises(DataFileMissingError, match=str(tmp_path)):
        load_dataset("pneumoniamnist", "val")  # env root is used, and it is empty
    monkeypatch.setenv("GRADLEAK_DATA", str(tmp_path / "missing"))
    with pytest.raises(DataFileMissingError, match="GRADLEAK_DATA"):
        resolve_data_root()


def test_shared_then_cache_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADLEAK_DATA", raising=False)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "proj").mkdir()
    monkeypatch.chdir(tmp_path / "proj")
    assert resolve_data_root() == (tmp_path / "shared" / "data").resolve()  # ../shared/data of the cwd
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(root_mod, "_project_root", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert resolve_data_root() == tmp_path / "cache" / "gradleak" / "data"


def test_registry_and_unknown_name() -> None:
    assert {"organamnist", "pneumoniamnist", "pathmnist", "cifar10", "femnist"} <= set(DATASETS.names())
    with pytest.raises(UnknownNameError, match="known datasets"):
        load_dataset("chestmnist")

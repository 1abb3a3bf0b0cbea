"""Aegis' cache store (issue 22): a client's built cache is kept by content and reloaded bit for bit by a
later process instead of being built again; other data or options that change the cache get another file,
options that do not change it reuse it; a damaged or altered file is built again, never trusted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gradleak.data.base import ImageDataset
from gradleak.defenses import aegis_synthetic
from gradleak.defenses.aegis_cache import CacheConfig
from gradleak.defenses.aegis_synthetic import AegisConfig, cache_from_data, clear_cache_memo
from gradleak.generators.base import fingerprint
from gradleak.update_io import read_tensors, write_tensors

SHAPE = (1, 8, 8)


def client(seed: int, n: int = 40) -> ImageDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    x = ((y[:, None, None, None] + 1) / 4 + 0.1 * torch.randn((n, *SHAPE), generator=g)).clamp(0, 1)
    return ImageDataset("t", x, y, 3)


def stored(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("aegis-cache-*.safetensors"))


def config(tmp_path: Path, **over: object) -> AegisConfig:
    base = AegisConfig(cache=CacheConfig(size=16, budget=1e9, chunk=8), memo_size=0, store=str(tmp_path))
    return dataclasses.replace(base, **over)


def refuse_to_build(*args: object, **kwargs: object) -> None:
    raise AssertionError("the cache was built again instead of reloaded")


def test_a_stored_cache_is_reloaded_bit_identically_instead_of_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clear_cache_memo()
    first = cache_from_data(client(0), config(tmp_path))
    assert len(stored(tmp_path)) == 1 and "reloaded" not in first.stats
    assert not list(tmp_path.glob("*.tmp"))  # written to a temporary file, then renamed
    monkeypatch.setattr(aegis_synthetic, "build_cache", refuse_to_build)
    again = cache_from_data(client(0), config(tmp_path))
    assert torch.equal(again.images, first.images) and torch.equal(again.labels, first.labels)
    assert again.stats["reloaded"] == 1.0 and again.stats["rejection_rate"] == first.stats["rejection_rate"]
    # options that do not change the cache reuse the file; without a store the cache is built
    cache_from_data(client(0), config(tmp_path, micro_batch=8, normalization="same_lr", memo_size=3))
    with pytest.raises(AssertionError, match="built again"):
        cache_from_data(client(0), config(tmp_path, store=None))
    clear_cache_memo()


def test_other_data_or_cache_options_get_a_file_of_their_own(tmp_path: Path) -> None:
    clear_cache_memo()
    base = cache_from_data(client(0), config(tmp_path))
    other_data = cache_from_data(client(1), config(tmp_path))
    other_seed = cache_from_data(client(0), config(tmp_path, cache_seed=1))
    other_size = cache_from_data(client(0), config(tmp_path, cache=CacheConfig(size=12, budget=1e9, chunk=8)))
    assert len(stored(tmp_path)) == 4
    assert not torch.equal(base.images, other_data.images) and not torch.equal(base.images, other_seed.images)
    assert len(other_size) == 12
    clear_cache_memo()


def test_a_damaged_or_altered_stored_cache_is_built_again(tmp_path: Path) -> None:
    clear_cache_memo()
    first = cache_from_data(client(0), config(tmp_path))
    (path,) = stored(tmp_path)
    path.write_bytes(b"not a cache")
    rebuilt = cache_from_data(client(0), config(tmp_path))
    assert torch.equal(rebuilt.images, first.images) and "reloaded" not in rebuilt.stats
    tensors, meta = read_tensors(path, "t")  # the rebuilt file reads again
    tensors["images"] = tensors["images"].flip(0)  # same key, content that no longer matches its digest
    write_tensors(path, tensors, meta)
    again = cache_from_data(client(0), config(tmp_path))
    assert torch.equal(again.images, first.images) and "reloaded" not in again.stats
    clear_cache_memo()


def test_the_store_option_is_checked_and_a_plain_generator_has_no_fingerprint() -> None:
    for bad in ("", 3):
        with pytest.raises(ValueError, match="store must be a folder name or None"):
            AegisConfig(store=bad)  # type: ignore[arg-type]
    assert fingerprint(object()) == ""

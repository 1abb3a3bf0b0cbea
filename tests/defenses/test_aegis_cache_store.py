"""Aegis' cache store (issue 22): a client's built cache is kept by content and reloaded bit for bit by a
later process instead of being built again; other data or options that change the cache get another file,
options that do not change it reuse it; a damaged or altered file is built again, never trusted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis import defense as aegis_synthetic
from gradleak.defenses.aegis.cache import CacheConfig
from gradleak.defenses.aegis.defense import AegisConfig, _stored_key, cache_from_data, clear_cache_memo
from gradleak.defenses.aegis.generators.base import PublicSplit, fingerprint
from gradleak.defenses.aegis.generators.diffusion import DiffusionGeneratorConfig, DiffusionTrainingConfig
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
    assert [p.name for p in tmp_path.iterdir()] == [stored(tmp_path)[0].name]  # no temporary file left
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


class Marked:
    """A stand-in generator with a settable fingerprint: seeded uniform images."""

    image_shape = SHAPE
    num_classes = 3
    mark = "a"

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        return torch.rand((len(labels), *SHAPE), generator=generator)

    def fingerprint(self) -> str:
        return self.mark


def test_the_generators_fingerprint_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clear_cache_memo()
    monkeypatch.setattr(
        aegis_synthetic.GENERATORS, "get", lambda name: lambda data, options, generator, root: Marked()
    )
    first = cache_from_data(client(0), config(tmp_path))
    cache_from_data(client(0), config(tmp_path))
    assert len(stored(tmp_path)) == 1  # the same fingerprint: reused
    monkeypatch.setattr(Marked, "mark", "b")  # other weights behind the same options: a file of its own
    other = cache_from_data(client(0), config(tmp_path))
    assert len(stored(tmp_path)) == 2 and "reloaded" not in other.stats
    assert torch.equal(other.images, first.images)  # the stand-in ignores its mark: same draws, new file
    clear_cache_memo()


def test_a_valid_cache_stored_under_another_key_is_built_again(tmp_path: Path) -> None:
    clear_cache_memo()
    first = cache_from_data(client(0), config(tmp_path))
    (path,) = stored(tmp_path)
    tensors, meta = read_tensors(path, "t")
    write_tensors(path, tensors, {**meta, "key": meta["key"].replace("gaussian", "oracle")})
    again = cache_from_data(client(0), config(tmp_path))
    assert "reloaded" not in again.stats and torch.equal(again.images, first.images)
    assert read_tensors(path, "t")[1]["key"] == meta["key"]  # and stored again under its own key
    clear_cache_memo()


def test_where_the_generator_is_stored_is_not_part_of_the_key() -> None:
    def key(**diffusion: object) -> str:
        options = DiffusionGeneratorConfig(train_on="public", public=PublicSplit("organamnist"), **diffusion)  # type: ignore[arg-type]
        return _stored_key(b"data", AegisConfig(generator="diffusion", diffusion=options), object())

    assert key(store="a") == key(store="b") == key()
    assert key(store="a") != key(store="a", training=DiffusionTrainingConfig(steps=10))


def test_the_store_option_is_checked_and_a_plain_generator_has_no_fingerprint() -> None:
    for bad in ("", 3):
        with pytest.raises(ValueError, match="store must be a folder name or None"):
            AegisConfig(store=bad)  # type: ignore[arg-type]
    assert fingerprint(object()) == ""


def test_an_audit_builds_each_clients_cache_once_across_its_attacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 56, item 3: every attack of an audit trains its clients again (two read-outs of Robbing the
    Fed here, and the round's clients before them), and each client's share is built into a cache once: as
    many builds as distinct shares, each a different share, none per attack."""
    from gradleak.cli.demo import demo_config_path
    from gradleak.defenses.aegis.generators.base import data_digest
    from gradleak.experiments import load_config, run_experiment

    built: list[bytes] = []
    build = aegis_synthetic.build_cache

    def counted(source, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(data_digest(data))
        return build(source, data, *args, **kwargs)

    monkeypatch.setattr(aegis_synthetic, "build_cache", counted)
    clear_cache_memo()
    cfg = load_config(
        demo_config_path(),
        ["data.train_limit=300", "data.test_limit=100", "data.num_clients=4", "fl.rounds=1",
         "fl.fraction=0.5", "audit.clients=2", "audit.training.protocol='fedavg'",
         "audit.training.batch_size=8", "audit.training.epochs=1", "audit.public_limit=50",
         "defenses=[{name='aegis', cache={size=16}, micro_batch=16}]",
         "audit.attacks=[{name='robbing_the_fed', num_bins=32}, "
         "{name='robbing_the_fed', num_bins=32, max_images=32}]"],
    )  # fmt: skip
    out = run_experiment(cfg)
    assert len(out.of_kind("attack")) == 4  # 2 clients x 2 attacks, each retraining its client
    assert all(a.get("refused") is None for a in out.of_kind("attack"))
    assert 2 <= len(built) <= 4 and len(set(built)) == len(built)  # round + audit shares, each once
    clear_cache_memo()

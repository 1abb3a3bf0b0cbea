"""The shared sample pool of a public diffusion generator (issue 22): sampled once, each client draws its
images of a requested class without replacement in its own order, the pool is stored and reused bit for bit,
a client that needs more than the pool holds fails closed, and only a public generator may have one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.defense import AegisConfig, cache_from_data, clear_cache_memo
from gradleak.defenses.aegis.generators.base import PublicSplit
from gradleak.defenses.aegis.generators.diffusion import DiffusionGeneratorConfig, diffusion_source
from gradleak.defenses.aegis.generators.pool import PoolDraws, PoolExhausted, SamplePool
from gradleak.models import build_model
from gradleak.options import OptionError, build_dataclass
from gradleak.registry import DEFENSES
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining
from gradleak.update_io import read_tensors, write_tensors

pytest.importorskip(
    "diffusers", reason="the diffusion generator needs diffusers (pip install 'gradleak[diffusion]')"
)

SHAPE = (1, 8, 8)


class Stripes:
    """A stand-in generator: class c is a constant image of brightness (c + 1) / 10 plus seeded noise, so a
    returned image's class and identity can be read off it."""

    image_shape = SHAPE
    num_classes = 3

    def __init__(self) -> None:
        self.calls = 0

    def sample(self, labels: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
        self.calls += 1
        base = (labels.to(torch.float32) + 1) / 10
        return (
            base[:, None, None, None] + 0.01 * torch.rand((len(labels), *SHAPE), generator=generator)
        ).clamp(0, 1)


def pool_of(per_class: int, seed: int = 0) -> SamplePool:
    return SamplePool.draw(
        Stripes(), [0, 1, 2], per_class, generator=torch.Generator().manual_seed(seed), chunk=7
    )


def rows(images: torch.Tensor) -> set[bytes]:
    return {x.numpy().tobytes() for x in images}


def test_draws_are_pool_images_of_the_class_without_replacement_in_the_clients_order() -> None:
    pool = pool_of(20)
    assert pool.images.shape == (60, *SHAPE) and torch.bincount(pool.labels).tolist() == [20, 20, 20]
    # chunked drawing is one stream: the same images as one call with the same generator
    whole = Stripes().sample(pool.labels, generator=torch.Generator().manual_seed(0))
    assert torch.equal(pool.images, whole)
    client = PoolDraws(pool, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([2, 0, 2, 1] * 5)
    first = client.sample(labels, generator=torch.Generator())
    second = client.sample(labels, generator=torch.Generator())
    both, both_labels = torch.cat([first, second]), torch.cat([labels, labels])
    assert len(rows(both)) == len(both)  # no image twice for one client
    for y in range(3):  # each image is a pool image of the requested class
        assert rows(both[both_labels == y]) <= rows(pool.images[pool.labels == y])
    same = PoolDraws(pool, generator=torch.Generator().manual_seed(1)).sample(
        labels, generator=torch.Generator()
    )
    other = PoolDraws(pool, generator=torch.Generator().manual_seed(2)).sample(
        labels, generator=torch.Generator()
    )
    assert torch.equal(first, same) and not torch.equal(first, other)


def test_a_client_that_needs_more_than_the_pool_holds_is_refused() -> None:
    client = PoolDraws(pool_of(4), generator=torch.Generator().manual_seed(0))
    client.sample(torch.tensor([1, 1, 1]), generator=torch.Generator())
    with pytest.raises(PoolExhausted, match="holds 4 images of class 1; this client asked for 5"):
        client.sample(torch.tensor([1, 1]), generator=torch.Generator())
    part = SamplePool.draw(Stripes(), [0, 1], 3, generator=torch.Generator())
    with pytest.raises(ValueError, match="no image of class 2"):
        PoolDraws(part, generator=torch.Generator()).sample(torch.tensor([2]), generator=torch.Generator())


def test_the_pool_is_stored_and_reloaded_bit_identically(tmp_path: Path) -> None:
    pool = pool_of(5)
    path = pool.save(tmp_path / "p.safetensors", key="k")
    again = SamplePool.load(path, key="k")
    assert torch.equal(again.images, pool.images) and torch.equal(again.labels, pool.labels)
    assert again.info == pool.info and again.num_classes == 3
    with pytest.raises(ValueError, match="not the sample pool of 'other'"):
        SamplePool.load(path, key="other")


def public_options(tmp_path: Path, **extra: object) -> dict[str, object]:
    """A 2-step public generator on the "halves" split (PublicSplit.load patched by each test)."""
    return {"train_on": "public", "public": {"dataset": "halves"}, "unet": {"channels": [8, 16]},
            "training": {"steps": 2}, "sampling": {"steps": 2}, "store": str(tmp_path), **extra}  # fmt: skip


def public_config(tmp_path: Path, **extra: object) -> DiffusionGeneratorConfig:
    return build_dataclass(DiffusionGeneratorConfig, public_options(tmp_path, **extra), where="t")


def halves(n: int, seed: int) -> ImageDataset:
    g = torch.Generator().manual_seed(seed)
    return ImageDataset(
        "halves", torch.rand((n, *SHAPE), generator=g), torch.randint(0, 3, (n,), generator=g), 3
    )


def test_the_public_generator_samples_its_pool_once_and_every_client_draws_from_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(PublicSplit, "load", lambda self, root=None: halves(60, seed=0))
    clear_cache_memo()
    draws: list[int] = []
    real_draw = SamplePool.draw.__func__  # type: ignore[attr-defined]

    def counting(cls: type, *args: object, **kw: object) -> object:
        draws.append(1)
        return real_draw(cls, *args, **kw)

    monkeypatch.setattr(SamplePool, "draw", classmethod(counting))
    cfg = public_config(tmp_path, pool=12)
    a = diffusion_source(halves(20, 1), cfg, generator=torch.Generator().manual_seed(1))
    b = diffusion_source(halves(20, 2), cfg, generator=torch.Generator().manual_seed(2))
    assert isinstance(a, PoolDraws) and isinstance(b, PoolDraws) and a.pool is b.pool and len(draws) == 1
    assert a.info["pool_per_class"] == 12 and a.info["train_images"] == 60
    (stored,) = tmp_path.glob("diffusion-pool-*.safetensors")
    clear_cache_memo()  # a new process: the stored pool, bit for bit, not sampled again
    c = diffusion_source(halves(20, 3), cfg, generator=torch.Generator())
    assert isinstance(c, PoolDraws) and torch.equal(c.pool.images, a.pool.images) and len(draws) == 1
    stored.write_bytes(b"damaged")
    clear_cache_memo()
    d = diffusion_source(halves(20, 3), cfg, generator=torch.Generator())  # sampled again: the same pool
    assert isinstance(d, PoolDraws) and torch.equal(d.pool.images, a.pool.images) and len(draws) == 2
    # guidance 1 and 1.0 are one pool; another size, seed or sampler another; no pool: the generator itself
    for extra in ({"sampling": {"steps": 2, "guidance": 2}}, {"sampling": {"steps": 2, "guidance": 2.0}}):
        diffusion_source(
            halves(20, 3), public_config(tmp_path, pool=12, **extra), generator=torch.Generator()
        )
    assert len(draws) == 3
    three = diffusion_source(halves(20, 3), public_config(tmp_path, pool=3), generator=torch.Generator())
    assert isinstance(three, PoolDraws) and len(three.pool.images) == 9
    diffusion_source(halves(20, 3), public_config(tmp_path, pool=12, seed=1), generator=torch.Generator())
    assert len(draws) == 5 and len(list(tmp_path.glob("diffusion-pool-*.safetensors"))) == 4
    assert not isinstance(diffusion_source(halves(20, 3), public_config(tmp_path)), PoolDraws)
    with pytest.raises(ValueError, match="needs the client's generator"):
        diffusion_source(halves(20, 3), cfg)
    clear_cache_memo()


def test_a_stored_pool_with_other_content_is_refused(tmp_path: Path) -> None:
    pool, other = pool_of(5), pool_of(5, seed=1)
    path = pool.save(tmp_path / "p.safetensors", key="k")
    _, meta = read_tensors(path, "p")
    write_tensors(path, {"images": other.images, "labels": other.labels}, meta)  # the key and old digest
    with pytest.raises(ValueError, match="do not match their digest"):
        SamplePool.load(path, key="k")
    pool.save(path, key="k")
    assert torch.equal(SamplePool.load(path, "k", SamplePool.layout([0, 1, 2], 5)).images, pool.images)
    with pytest.raises(ValueError, match="per-class size are not the ones asked for"):
        SamplePool.load(path, key="k", labels=SamplePool.layout([0, 1, 2], 6))
    with pytest.raises(ValueError, match=r"finite and in \[0, 1\]"):
        SamplePool(pool.images + 1, pool.labels, 3, {})


def test_aegis_builds_distinct_caches_from_the_pool_and_fails_closed_when_it_runs_dry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(PublicSplit, "load", lambda self, root=None: halves(60, seed=0))
    clear_cache_memo()
    options = public_options(tmp_path, pool=40)
    aegis = build_dataclass(
        AegisConfig,
        {
            "generator": "diffusion",
            "diffusion": options,
            "cache": {"size": 24, "budget": 1e9, "chunk": 8},
            "memo_size": 0,
        },
        where="t",
    )
    one, two = cache_from_data(halves(30, 4), aegis), cache_from_data(halves(30, 5), aegis)
    (pool,) = tmp_path.glob("diffusion-pool-*.safetensors")
    pool_images = rows(load_file(str(pool))["images"])
    for cache in (one, two):  # every candidate from the pool, none twice in a cache
        assert len(rows(cache.images)) == 24 and rows(cache.images) <= pool_images
    assert rows(one.images) != rows(two.images)  # each client in its own order
    assert torch.equal(cache_from_data(halves(30, 4), aegis).images, one.images)  # a function of the data
    # a pool too small for the cache: the client's update is withheld, with the reason
    small = DEFENSES.create(
        "aegis",
        generator="diffusion",
        diffusion={**options, "pool": 2},
        cache={"size": 24, "budget": 1e9, "chunk": 8},
        micro_batch=24,
        memo_size=0,
    )
    model = build_model("lenet", SHAPE, 3, seed=0)
    res = train_client(
        0, model, halves(30, 6), LocalTraining(epochs=1, batch_size=10), [small], torch.Generator()
    )
    assert res.update is None and "raise the pool's per-class size" in (res.error or "")
    clear_cache_memo()


def test_a_pool_needs_a_public_generator_and_a_size() -> None:
    for bad, match in (
        ({"pool": 8}, "needs train_on = 'public'"),
        ({"pool": -1}, "pool must be an int >= 0"),
        ({"pool": True, "train_on": "public", "public": {"dataset": "x"}}, "expected int, got bool"),
    ):
        with pytest.raises(OptionError, match=match):
            build_dataclass(DiffusionGeneratorConfig, bad, where="diffusion")

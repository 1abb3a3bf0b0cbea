"""The class-conditional diffusion generator (issue 22): its samples carry the requested class, it saves and
reloads bit-identically and is reused by content, Aegis builds its cache with it from a config, and without
``diffusers`` asking for it is a clear error that withholds the update (fail closed)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from gradleak.data.base import ImageDataset
from gradleak.defenses.aegis.defense import clear_cache_memo
from gradleak.defenses.aegis.generators import diffusion as diffusion_mod
from gradleak.defenses.aegis.generators.base import PublicSplit, fingerprint
from gradleak.defenses.aegis.generators.diffusion import (
    DiffusionGenerator,
    DiffusionGeneratorConfig,
    fit_diffusion,
)
from gradleak.defenses.aegis.generators.oracle import OracleGeneratorConfig
from gradleak.device import DeviceError
from gradleak.models import build_model
from gradleak.options import OptionError, build_dataclass
from gradleak.registry import DEFENSES, GENERATORS
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining

pytest.importorskip(
    "diffusers", reason="the diffusion generator needs diffusers (pip install 'gradleak[diffusion]')"
)

SHAPE = (1, 8, 8)
# three classes of 8 x 8 images: the left, right or top half bright, plus pixel noise
MASKS = torch.zeros(3, *SHAPE)
MASKS[0, :, :, :4] = 1
MASKS[1, :, :, 4:] = 1
MASKS[2, :, :4, :] = 1


def halves(n: int, seed: int) -> ImageDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = (0.15 + 0.7 * MASKS[y] + 0.05 * torch.randn((n, *SHAPE), generator=g)).clamp(0, 1)
    return ImageDataset("halves", x, y, 3)


def tiny_config(store: str | None = None, **training: object) -> DiffusionGeneratorConfig:
    return build_dataclass(
        DiffusionGeneratorConfig,
        {
            "unet": {"channels": [8, 16]},
            "training": {"steps": 300, "batch_size": 32, "warmup": 20, **training},
            "sampling": {"guidance": 2.0},
            "store": store,
        },
        where="test",
    )


@pytest.fixture(scope="module")
def trained() -> tuple[ImageDataset, DiffusionGenerator]:
    data = halves(240, seed=0)
    return data, DiffusionGenerator.fit(data, tiny_config(), generator=torch.Generator().manual_seed(0))


def test_samples_are_classified_as_the_requested_class(trained: tuple) -> None:
    data, gen = trained
    clf = torch.nn.Linear(64, 3)  # a softmax classifier trained on real images only (seeded)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        clf.reset_parameters()
    opt = torch.optim.Adam(clf.parameters(), lr=0.05)
    for _ in range(100):
        opt.zero_grad()
        F.cross_entropy(clf(data.images.flatten(1)), data.labels).backward()
        opt.step()
    held = halves(150, seed=1)
    assert float((clf(held.images.flatten(1)).argmax(1) == held.labels).float().mean()) == 1.0
    labels = torch.arange(3).repeat_interleave(50)
    x = gen.sample(labels, generator=torch.Generator().manual_seed(1))
    assert x.shape == (150, *SHAPE) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    acc = float((clf(x.flatten(1)).argmax(1) == labels).float().mean())
    assert acc >= 0.8, acc  # chance is 1/3; measured 0.95 (300 steps)
    # and the bright half is where the class puts it: mean brightness inside the mask above outside
    inside = (x * MASKS[labels]).sum((1, 2, 3)) / MASKS[labels].sum((1, 2, 3))
    outside = (x * (1 - MASKS[labels])).sum((1, 2, 3)) / (1 - MASKS[labels]).sum((1, 2, 3))
    assert float((inside - outside).mean()) > 0.3


def test_sampling_is_seeded_and_refuses_unknown_classes(trained: tuple) -> None:
    _, gen = trained
    labels = torch.tensor([0, 1, 2, 2])
    a = gen.sample(labels, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, gen.sample(labels, generator=torch.Generator().manual_seed(5)))
    assert not torch.equal(a, gen.sample(labels, generator=torch.Generator().manual_seed(6)))
    two = halves(60, seed=2)
    two = two.subset(np.flatnonzero(two.labels.numpy() < 2))
    small = DiffusionGenerator.fit(two, tiny_config(steps=2), generator=torch.Generator())
    with pytest.raises(ValueError, match=r"not trained on classes \[2\]"):
        small.sample(torch.tensor([2]), generator=torch.Generator())


def test_cpu_forward_slices_give_the_same_samples(trained: tuple) -> None:
    _, gen = trained
    sizes: list[int] = []
    hook = gen.unet.register_forward_pre_hook(lambda _m, args: sizes.append(len(args[0])))
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    try:
        gen.cpu_forward_images = 1000
        whole = gen.sample(labels, generator=torch.Generator().manual_seed(4))
        assert set(sizes) == {14}  # guided: the labelled and the null half in one forward
        sizes.clear()
        gen.cpu_forward_images = 4
        sliced = gen.sample(labels, generator=torch.Generator().manual_seed(4))
        assert sizes[:4] == [4, 4, 4, 2] and max(sizes) == 4
        gen.cpu_forward_images = 0
        with pytest.raises(ValueError, match="cpu_forward_images must be an int >= 1"):
            gen.sample(labels, generator=torch.Generator())
    finally:
        hook.remove()
        gen.cpu_forward_images = diffusion_mod.CPU_FORWARD_IMAGES
    # GroupNorm normalises each image alone: only rounding may differ (measured: none)
    torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=0)


def test_the_fingerprint_follows_the_weights_and_the_sampler(trained: tuple) -> None:
    _, gen = trained
    again = DiffusionGenerator(
        copy.deepcopy(gen.unet), gen.config, gen.image_shape, gen.num_classes, gen.classes
    )
    assert again.fingerprint() == gen.fingerprint() and fingerprint(gen) == gen.fingerprint()
    with torch.no_grad():
        next(again.unet.parameters()).view(-1)[0] += 1e-3
    assert again.fingerprint() != gen.fingerprint()
    fewer = dataclasses.replace(gen.config, sampling=dataclasses.replace(gen.config.sampling, steps=4))
    other = DiffusionGenerator(gen.unet, fewer, gen.image_shape, gen.num_classes, gen.classes)
    assert other.fingerprint() != gen.fingerprint()


def test_saved_generator_reloads_bit_identically(trained: tuple, tmp_path: Path) -> None:
    _, gen = trained
    path = gen.save(tmp_path / "g.safetensors")
    assert not list(tmp_path.glob("*.tmp"))  # written to a temporary file, then renamed
    again = DiffusionGenerator.load(path)
    for (k, v), (k2, v2) in zip(gen.unet.state_dict().items(), again.unet.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k
    assert again.config == gen.config and again.classes == gen.classes and again.info == gen.info
    labels = torch.tensor([0, 1, 2])
    assert torch.equal(
        gen.sample(labels, generator=torch.Generator().manual_seed(3)),
        again.sample(labels, generator=torch.Generator().manual_seed(3)),
    )
    (tmp_path / "other.safetensors").write_bytes(b"not a generator")
    with pytest.raises(Exception, match="header|safetensors|generator"):
        DiffusionGenerator.load(tmp_path / "other.safetensors")


def test_a_damaged_stored_generator_is_trained_again(tmp_path: Path) -> None:
    data, cfg = halves(40, seed=12), tiny_config(store=str(tmp_path), steps=2)
    first = fit_diffusion(data, cfg)
    (path,) = tmp_path.glob("diffusion-*.safetensors")
    path.write_bytes(b"truncated")
    again = fit_diffusion(data, cfg)
    assert "reused" not in again.info and again.info["saved"] == str(path)
    for v, w in zip(first.unet.state_dict().values(), again.unet.state_dict().values(), strict=True):
        assert torch.equal(v, w)  # the same weights: a function of the data and the options
    assert "reused" in fit_diffusion(data, cfg).info


def test_fit_reuses_the_stored_generator_by_content(tmp_path: Path) -> None:
    data = halves(60, seed=3)
    cfg = tiny_config(store=str(tmp_path), steps=3)
    first = fit_diffusion(data, cfg)
    assert len(list(tmp_path.glob("diffusion-*.safetensors"))) == 1 and "saved" in first.info
    second = fit_diffusion(data, cfg)
    assert second.info.get("reused") == first.info["saved"]
    for v, w in zip(first.unet.state_dict().values(), second.unet.state_dict().values(), strict=True):
        assert torch.equal(v, w)
    # other data or other training options: another file; other sampling options: the same one
    fit_diffusion(halves(60, seed=4), cfg)
    fit_diffusion(data, tiny_config(store=str(tmp_path), steps=4))
    resampled = build_dataclass(
        DiffusionGeneratorConfig,
        {
            "unet": {"channels": [8, 16]},
            "store": str(tmp_path),
            "training": {"steps": 3, "batch_size": 32, "warmup": 20},
            "sampling": {"steps": 4},
        },
        where="t",
    )
    assert "reused" in fit_diffusion(data, resampled).info
    assert len(list(tmp_path.glob("diffusion-*.safetensors"))) == 3


def test_options_are_checked_on_construction() -> None:
    for bad, match in (
        ({"train_on": "everyone"}, "train_on"),
        ({"train_on": "public"}, "public"),
        ({"unet": {"channels": [12, 16]}}, "multiples of norm_groups"),
        ({"sampling": {"sampler": "euler"}}, "sampler"),
        ({"sampling": {"guidance": 0.5}}, "guidance"),
        ({"sampling": {"spacing": "middle"}}, "spacing"),
        ({"training": {"class_dropout": 1.0}}, "class_dropout"),
        ({"training": {"stepz": 3}}, "unknown option"),
        ({"training": {"class_dropout": 0.0}}, "null class is never trained"),
        ({"sampling": {"steps": 50}, "training": {"timesteps": 50}}, "below training.timesteps"),
        ({"device": "gpu0"}, "'cpu' or 'cuda'"),
        ({"device": "meta"}, "'cpu' or 'cuda'"),
        ({"device": 0}, "expected str"),
    ):
        with pytest.raises(OptionError, match=match):
            build_dataclass(DiffusionGeneratorConfig, bad, where="diffusion")
    four_levels = build_dataclass(DiffusionGeneratorConfig, {"unet": {"channels": [8] * 5}}, where="t")
    with pytest.raises(ValueError, match="halve"):  # 8 x 8 does not halve four times
        DiffusionGenerator.fit(halves(10, 0), four_levels, generator=torch.Generator())
    assert "diffusion" in GENERATORS and "gaussian" in GENERATORS and "oracle" in GENERATORS


def test_aegis_builds_its_cache_with_the_diffusion_generator(tmp_path: Path) -> None:
    clear_cache_memo()
    data = halves(120, seed=5)
    options = {
        "unet": {"channels": [8, 16]},
        "training": {"steps": 200, "batch_size": 32, "warmup": 20},
        "store": str(tmp_path),
    }
    # the acceptance budget is opened: this checks the plumbing (OrganAMNIST's acceptance: docs/defenses.md)
    aegis = DEFENSES.create(
        "aegis",
        generator="diffusion",
        diffusion=options,
        cache={"size": 64, "budget": 1e9},
        micro_batch=64,
        real_batch_size=16,
        memo_size=0,
    )
    model = build_model("lenet", SHAPE, 3, seed=0)
    res = train_client(0, model, data, LocalTraining(epochs=1, batch_size=16), [aegis], torch.Generator())
    assert res.update is not None and aegis.steps == 1, res.error
    cache = aegis.active_cache
    assert cache is not None and cache.images.shape == (64, *SHAPE)
    assert cache.stats["generator_train_images"] == 120 and set(cache.labels.tolist()) <= {0, 1, 2}
    assert len(list(tmp_path.glob("diffusion-*.safetensors"))) == 1  # kept for the next run
    clear_cache_memo()


def test_without_diffusers_it_is_a_clear_error_and_aegis_fails_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.import_module

    def no_diffusers(name: str, *args: object) -> object:
        if name.split(".")[0] == "diffusers":
            raise ImportError("No module named 'diffusers'")
        return real(name, *args)

    monkeypatch.setattr(diffusion_mod.importlib, "import_module", no_diffusers)
    assert not diffusion_mod.diffusers_available()
    with pytest.raises(ImportError, match=r"pip install 'gradleak\[diffusion\]'"):
        fit_diffusion(halves(10, 0), tiny_config())
    clear_cache_memo()
    aegis = DEFENSES.create(
        "aegis",
        generator="diffusion",
        diffusion={"store": None},
        cache={"size": 16},
        micro_batch=16,
        memo_size=0,
    )
    model = build_model("lenet", SHAPE, 3, seed=0)
    res = train_client(
        0, model, halves(30, 0), LocalTraining(epochs=1, batch_size=10), [aegis], torch.Generator()
    )
    assert res.update is None and "gradleak[diffusion]" in (res.error or "")


def test_one_public_generator_serves_every_client(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    public = halves(90, seed=7)
    monkeypatch.setattr(PublicSplit, "load", lambda self, root=None: public)
    fits: list[int] = []
    real_fit = DiffusionGenerator.fit.__func__  # type: ignore[attr-defined]

    def counting(cls: type, data: ImageDataset, config: DiffusionGeneratorConfig, **kw: object) -> object:
        fits.append(len(data))
        return real_fit(cls, data, config, **kw)

    monkeypatch.setattr(DiffusionGenerator, "fit", classmethod(counting))
    cfg = build_dataclass(
        DiffusionGeneratorConfig,
        {
            "train_on": "public",
            "public": {"dataset": "halves"},
            "unet": {"channels": [8, 16]},
            "training": {"steps": 2},
            "store": str(tmp_path),
        },
        where="t",
    )
    a, b = fit_diffusion(halves(30, seed=8), cfg), fit_diffusion(halves(40, seed=9), cfg)
    assert a is b and fits == [90]  # trained once, on the public split, not on either client's share
    other = dataclasses.replace(cfg, store=None, seed=1)  # not in the process memo: checked again
    wide = ImageDataset("wide", torch.rand(5, 1, 8, 16), torch.zeros(5, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="public split halves/val has"):
        fit_diffusion(wide, other)


def test_the_oracle_draws_real_images_of_the_requested_class(monkeypatch: pytest.MonkeyPatch) -> None:
    public = halves(60, seed=10)
    monkeypatch.setattr(PublicSplit, "load", lambda self, root=None: public)
    cfg = build_dataclass(OracleGeneratorConfig, {"public": {"dataset": "halves"}}, where="t")
    oracle = GENERATORS.get("oracle")(halves(20, seed=11), cfg)
    labels = torch.tensor([0, 2, 2, 1, 0])
    x = oracle.sample(labels, generator=torch.Generator().manual_seed(0))
    for img, y in zip(x, labels, strict=True):
        match = (public.images == img).flatten(1).all(1)
        assert match.any() and set(public.labels[match].tolist()) == {int(y)}
    with pytest.raises(ValueError, match="holds 20 of the client's own images"):  # fail closed
        GENERATORS.get("oracle")(public.subset(np.arange(20)), cfg)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="no public split named"):
        GENERATORS.get("oracle")(halves(20, seed=11), OracleGeneratorConfig())
    # the generator's name is matched as the registry matches it, and its own table is used
    aegis = DEFENSES.create("aegis", generator="Oracle", oracle={"public": {"dataset": "halves"}})
    assert aegis.config.generator == "oracle" and aegis.config.generator_options.public.dataset == "halves"


def test_the_sampling_spacing_places_the_steps() -> None:
    """``sampling.spacing`` reaches the scheduler: with T = 1000 and 10 steps "leading" starts at t = 900
    and "trailing" at 999 (diffusers' timestep_spacing), for both samplers; and it changes the samples."""
    diffusers = diffusion_mod.require_diffusers()
    config = diffusion_mod._schedule(diffusers, tiny_config().training).config
    for sampler in diffusion_mod.SAMPLERS:
        for spacing, first in (("leading", 900), ("trailing", 999)):
            scheduler = diffusion_mod.SAMPLERS[sampler](diffusers, config, spacing)
            scheduler.set_timesteps(10)
            assert int(scheduler.timesteps[0]) == first, (sampler, spacing)
    made = DiffusionGenerator.fit(halves(20, seed=5), tiny_config(steps=2), generator=torch.Generator())
    labels = torch.tensor([0, 1])
    leading = made.sample(labels, generator=torch.Generator().manual_seed(0))
    made.config = dataclasses.replace(
        made.config, sampling=dataclasses.replace(made.config.sampling, spacing="trailing")
    )
    trailing = made.sample(labels, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(leading, trailing, atol=1e-3)


def test_the_device_is_checked_before_work_and_is_not_part_of_the_stored_generator(
    trained: tuple, tmp_path: Path
) -> None:
    data, gen = trained
    cfg = tiny_config(store=str(tmp_path), steps=2)
    on_gpu = dataclasses.replace(cfg, device="cuda")
    # one file for every device: a generator trained on a GPU is reused by a CPU run of the same options
    digest = diffusion_mod.data_digest(data)
    assert diffusion_mod.stored_name(digest, cfg) == diffusion_mod.stored_name(digest, on_gpu)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA device"):
            fit_diffusion(data, on_gpu)
        assert not list(tmp_path.iterdir())  # refused before any training or file
        fit_diffusion(data, cfg)  # stored now: a GPU config must still be refused, not load and fail later
        with pytest.raises(DeviceError, match="no CUDA device"):
            fit_diffusion(data, on_gpu)
    # saved with where it ran: a load samples on the device it is given (the CPU by default)
    moved = DiffusionGenerator(gen.unet, dataclasses.replace(gen.config, device="cuda:3"), gen.image_shape,
                               gen.num_classes, gen.classes, {**gen.info, "device": "cuda:3"})  # fmt: skip
    again = DiffusionGenerator.load(moved.save(tmp_path / "g.safetensors"))
    assert again.config.device == "cpu" and again.info["device"] == "cuda:3"
    labels = torch.tensor([0, 1, 2])
    assert torch.equal(
        gen.sample(labels, generator=torch.Generator().manual_seed(5)),
        again.sample(labels, generator=torch.Generator().manual_seed(5)),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the lent GPU machine)")
def test_a_generator_trained_on_the_gpu_samples_on_the_cpu_like_on_the_gpu(tmp_path: Path) -> None:
    data = halves(60, seed=5)
    cfg = dataclasses.replace(tiny_config(store=str(tmp_path), steps=20), device="cuda")
    made = fit_diffusion(data, cfg)
    assert all(p.device.type == "cuda" for p in made.unet.parameters()) and made.info["device"] == "cuda:0"
    on_cpu = fit_diffusion(data, dataclasses.replace(cfg, device="cpu"))  # the same file, loaded on the CPU
    assert on_cpu.info["reused"] == made.info["saved"]
    for v, w in zip(made.unet.state_dict().values(), on_cpu.unet.state_dict().values(), strict=True):
        assert torch.equal(v.cpu(), w)
    labels = torch.tensor([0, 1, 2] * 4)
    gpu = made.sample(labels, generator=torch.Generator().manual_seed(2))
    cpu = on_cpu.sample(labels, generator=torch.Generator().manual_seed(2))
    # the same noise, weights and solver: only the kernels' rounding differs (no TF32: fp32 throughout)
    assert gpu.device.type == "cpu" and torch.allclose(gpu, cpu, atol=1e-3), (gpu - cpu).abs().max()


def test_quality_gated_training_stops_at_the_first_check_that_passes(tmp_path: Path) -> None:
    """Issue 56: the training length is the gate's. A seeded small case (the three-halves classes, a tiny
    UNet, a check every 50 steps up to a 600-step cap) stops at the first check whose class fidelity reaches
    0.9 x the reference classifier's held-out ceiling: every earlier check failed, the weights kept are the
    EMA weights that check scored, and a gate no generator can pass (fidelity 1.0 of the ceiling and a
    Frechet distance of 1e-9) runs to the cap, is checked there, and says it did not pass."""
    from gradleak.defenses.aegis.generators.quality import TrainingGate

    data = halves(240, seed=0)
    gate = {"every": 50, "fidelity": 0.9, "heldout": 0.2, "samples_per_class": 16, "classifier_epochs": 20}
    config = tiny_config(str(tmp_path), steps=600, gate=gate)
    assert isinstance(config.training.gate, TrainingGate)
    gen = DiffusionGenerator.fit(data, config, generator=torch.Generator().manual_seed(0))
    info = gen.info["gate"]
    history, ceiling = info["history"], info["ceiling"]
    assert ceiling >= 0.9  # the halves are easy: the reference classifier's held-out accuracy
    assert info["passed"] and info["passed_at"] == history[-1]["step"] == gen.info["train_steps"] < 600
    assert [h["step"] for h in history] == list(range(50, info["passed_at"] + 1, 50))
    assert history[-1]["fidelity"] >= 0.9 * ceiling
    assert all(h["fidelity"] < 0.9 * ceiling for h in history[:-1])
    assert gen.info["train_images"] == 240 - 48  # 20 % of each class held out of training
    assert history[-1]["weights"] == gen.weights_digest()  # the kept weights are the EMA weights scored
    assert len({h["weights"] for h in history}) == len(history)

    strict = tiny_config(None, steps=150, gate={**gate, "fidelity": 1.0, "frechet": 1e-9})
    capped = DiffusionGenerator.fit(data, strict, generator=torch.Generator().manual_seed(0))
    assert capped.info["train_steps"] == 150 and not capped.info["gate"]["passed"]
    assert [h["step"] for h in capped.info["gate"]["history"]] == [50, 100, 150]


@pytest.mark.parametrize(
    "gate, message",
    [({"every": 0}, "every"), ({"fidelity": 1.5}, "fidelity"), ({"heldout": 1}, "heldout"),
     ({"frechet": -1.0}, "frechet"), ({"evry": 5}, "evry"), ({"every": 500}, "must not exceed steps"),
     ({"min_steps": 301}, "must not exceed steps")],
)  # fmt: skip
def test_a_bad_gate_is_refused_by_name(gate: dict, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        tiny_config(None, gate=gate)


def test_the_held_out_split_keeps_every_class_in_training() -> None:
    """A large held-out share never takes a class's last training image (it could not be sampled)."""
    from gradleak.defenses.aegis.generators.quality import split_heldout

    labels = torch.tensor([0, 0, 1, 1, 1, 1, 1, 2])
    data = ImageDataset("t", torch.rand(8, *SHAPE), labels, 3)
    train, held = split_heldout(data, 0.9, torch.Generator().manual_seed(0))
    assert sorted(train.labels.tolist()) == [0, 1, 2]  # one of each kept; class 2 (one image) not held out
    assert sorted(held.labels.tolist()) == [0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="two or more"):
        split_heldout(
            ImageDataset("t", torch.rand(2, *SHAPE), torch.tensor([0, 1]), 2), 0.5, torch.Generator()
        )

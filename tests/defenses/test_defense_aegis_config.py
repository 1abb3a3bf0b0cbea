"""Aegis from a config: the client's data and data root reach defenses through ``setup``'s context,
Aegis builds and memoises its cache from it, failures while doing so fail closed, and through the runner
the update carries no cache and Robbing the Fed's reconstruction rate falls against no defense."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradleak.experiments.runner as runner
from gradleak.data import load_dataset
from gradleak.data.base import ImageDataset
from gradleak.data.root import resolve_data_root
from gradleak.defenses.aegis.cache import CacheConfig, SyntheticCache
from gradleak.defenses.aegis.defense import (
    AegisConfig,
    cache_from_data,
    clear_cache_memo,
    memoised_caches,
)
from gradleak.defenses.base import Defense, DefenseChain, DefenseFailure, SetupContext
from gradleak.experiments import load_config, run_experiment
from gradleak.models import build_model
from gradleak.registry import DEFENSES
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)


class DataAware(Defense):
    """Records the context of every setup."""

    name = "data-aware"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.seen: list[SetupContext] = []

    def setup(self, model: nn.Module, context: SetupContext) -> None:
        self.seen.append(context)
        if self.fail:
            raise ValueError("cannot use this client's data")


def organ_share(n: int = 300, offset: int = 0) -> ImageDataset:
    pool = load_dataset("organamnist", "train", limit=3000)
    return pool.subset(np.flatnonzero(pool.labels.numpy() < 4)[offset : offset + n])


def test_every_defense_of_a_chain_gets_the_one_setup_context() -> None:
    """The context replaces signature inspection: every defense gets the generator, the client's private
    data, what training draws from (the data when not given) and the data root; train_client passes its
    share (or the whole share behind an audit's subset) and the engine's data root."""
    model = build_model("lenet", SHAPE, 3, seed=0)
    data = synthetic_dataset(n=10, shape=SHAPE)
    first, second = DataAware(), DataAware()
    gen = torch.Generator()
    DefenseChain([first, second]).setup(model, SetupContext(gen, data, data_root="/elsewhere"))
    assert first.seen == second.seen and first.seen[0].generator is gen
    assert first.seen[0].data is data and first.seen[0].train_data is data
    assert first.seen[0].data_root == "/elsewhere"
    with pytest.raises(TypeError, match="needs a torch.Generator"):
        SetupContext(0)  # type: ignore[arg-type]
    aware = DataAware()
    whole = synthetic_dataset(n=30, shape=SHAPE, seed=3)
    res = train_client(0, model, data, LocalTraining(epochs=1, batch_size=5), [aware], torch.Generator(),
                       private=whole, data_root="/r")  # fmt: skip
    context = aware.seen[-1]
    assert res.update is not None and res.update.num_samples == len(data)
    assert context.data is whole and context.train_data is data and context.data_root == "/r"


def test_the_experiments_data_root_reaches_aegis_public_split(tmp_path, monkeypatch) -> None:
    """Issue 51 defect: ``experiment.data_root`` did not reach Aegis' public split, which read the default
    root, so an audit whose data lives under its own root lost every Aegis client in setup. Here the
    default root is empty and the experiment's root holds OrganAMNIST: the oracle generator's public split
    loads from the experiment's root, through the runner, and the audited update is defended."""
    root = tmp_path / "root"
    (root / "medmnist").mkdir(parents=True)
    shared = resolve_data_root(None)
    (root / "medmnist" / "organamnist.npz").symlink_to(shared / "medmnist" / "organamnist.npz")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("GRADLEAK_DATA", str(empty))
    aegis = {"name": "aegis", "cache": {"size": 64}, "micro_batch": 64, "real_batch_size": 8,
             "generator": "oracle", "oracle": {"public": {"dataset": "organamnist", "split": "test",
                                                          "limit": 600}}}  # fmt: skip
    raw = {
        "experiment": {"name": "root", "seed": 0, "data_root": str(root)},
        "data": {"dataset": "organamnist", "train_limit": 300, "test_limit": 50, "num_clients": 3,
                 "partition": "iid"},
        "model": {"name": "aegis_cnn"},
        "fl": {"rounds": 1, "fraction": 1.0, "training": {"protocol": "fedavg", "batch_size": 8}},
        "audit": {"clients": 1, "attacks": [{"name": "ig", "max_iterations": 2}],
                  "training": {"protocol": "fedavg", "batch_size": 8}},
        "defenses": [aegis],
    }  # fmt: skip
    outcome = run_experiment(load_config(raw))
    assert outcome.of_kind("client_error") == []  # before the fix: "public split ... file not found"
    assert len(outcome.of_kind("attack")) == 1  # the audited client's defended update was attacked
    # the same defense without the root (the default one is empty) fails closed, naming the missing file
    model = build_model("aegis_cnn", (1, 28, 28), 11, seed=0)
    share = load_dataset("organamnist", "train", root=root, limit=64)
    res = train_client(0, model, share, LocalTraining(epochs=1, batch_size=8),
                       [DEFENSES.create("aegis", **{k: v for k, v in aegis.items() if k != "name"})],
                       torch.Generator())  # fmt: skip
    assert res.update is None and "organamnist" in (res.error or "")


def test_a_defense_failing_in_setup_with_data_fails_closed() -> None:
    model = build_model("lenet", SHAPE, 3, seed=0)
    data = synthetic_dataset(n=10, shape=SHAPE)
    with pytest.raises(DefenseFailure, match="data-aware.*setup.*this client's data"):
        DefenseChain([DataAware(fail=True)]).setup(model, SetupContext(torch.Generator(), data))
    chain = [DataAware(), DataAware(fail=True)]
    res = train_client(3, model, data, LocalTraining(epochs=1, batch_size=5), chain, torch.Generator())
    assert res.update is None and res.truth is None and "this client's data" in (res.error or "")
    # Aegis whose cache cannot be built from the client's data (one image per class: no generator fit)
    single = ImageDataset("one-each", torch.rand(3, *SHAPE), torch.arange(3), 3)
    aegis = DEFENSES.create("aegis", cache={"size": 16}, micro_batch=16, memo_size=0)
    res = train_client(0, model, single, LocalTraining(epochs=1, batch_size=3), [aegis], torch.Generator())
    assert res.update is None and "failed in setup" in (res.error or "") and "no class" in (res.error or "")
    # a budget no candidate meets: the cache error withholds the update
    share = organ_share(60)
    strict = DEFENSES.create(
        "aegis", cache={"size": 32, "budget": 1e-9, "max_candidates_factor": 2.0}, memo_size=0
    )
    cnn = build_model("aegis_cnn", share.input_shape, 11, seed=0)
    res = train_client(0, cnn, share, LocalTraining(epochs=1, batch_size=32), [strict], torch.Generator())
    assert res.update is None and "cannot fill its cache" in (res.error or "")  # the pilot says so


def test_aegis_builds_its_cache_from_the_clients_data_and_memoises_it() -> None:
    clear_cache_memo()
    a, b = organ_share(200), organ_share(200, offset=200)
    cfg = AegisConfig(cache=CacheConfig(size=128), micro_batch=128, real_batch_size=32)
    ca = cache_from_data(a, cfg)
    assert cache_from_data(a, cfg) is ca  # memo hit: same client data, same options
    assert (
        cache_from_data(a, AegisConfig(cache=CacheConfig(size=128), normalization="same_lr")) is ca
    )  # step option only
    cb = cache_from_data(b, cfg)
    assert cb is not ca and not torch.equal(ca.images, cb.images)  # never shared between clients
    again = cache_from_data(a, AegisConfig(cache=CacheConfig(size=128), memo_size=0))
    assert again is not ca and torch.equal(again.images, ca.images)  # deterministic without the memo
    assert set(ca.labels.tolist()) <= set(a.labels.tolist()) and ca.images.shape == (128, *a.input_shape)
    assert len(memoised_caches()) == 2
    # one instance reused across clients uses each client's own cache
    aegis = DEFENSES.create("aegis", cache={"size": 128}, micro_batch=128, real_batch_size=32)
    model = build_model("aegis_cnn", a.input_shape, 11, seed=0)
    training = LocalTraining(epochs=1, batch_size=32)
    for data, cache in ((a, ca), (b, cb), (a, ca)):
        res = train_client(0, model, data, training, [aegis], torch.Generator().manual_seed(0))
        assert res.update is not None and aegis.active_cache is cache and aegis.steps == 1
    with pytest.raises(ValueError, match="memo_size"):
        AegisConfig(memo_size=-1)
    with pytest.raises(ValueError, match="generator"):
        AegisConfig(generator="stable-diffusion")
    clear_cache_memo()
    assert memoised_caches() == []


def _config(defenses: list[dict[str, Any]]) -> Any:
    return load_config(
        {
            "experiment": {"name": "aegis-config-test", "seed": 0},
            "data": {"dataset": "organamnist", "train_limit": 4000, "test_limit": 500, "num_clients": 8,
                     "partition": "label_skew", "partition_options": {"max_classes_per_client": 5}},
            "fl": {"rounds": 0, "fraction": 0.25},
            "audit": {
                "clients": 1, "max_samples": 32, "public_limit": 500,
                "training": {"protocol": "fedavg", "epochs": 1, "batch_size": 32, "optimizer": "sgd"},
                "attacks": [{"name": "robbing_the_fed", "num_bins": 128},
                            {"name": "robbing_the_fed", "num_bins": 128, "max_images": 128}],
            },
            "defenses": defenses,
        }
    )  # fmt: skip


def test_aegis_from_a_config_dict_through_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """OrganAMNIST, one audited client training on 32 of its ~500 images (SGD, E = 1), 128 bins; Aegis
    M = 512 built by the client from its share in setup. Top-B and all-bins read-outs."""
    clear_cache_memo()
    sent: list[Any] = []
    real_view = runner.server_view

    def spy(broadcast: nn.Module, results: Any, **kwargs: Any) -> Any:
        sent.extend(results)
        return real_view(broadcast, results, **kwargs)

    monkeypatch.setattr(runner, "server_view", spy)
    rates, updates = {}, {}
    for label, defenses in {
        "none": [],
        "aegis": [{"name": "aegis", "cache": {"size": 512}, "real_batch_size": 32}],
    }.items():
        sent.clear()
        out = run_experiment(_config(defenses))
        attacks = out.of_kind("attack")
        assert len(attacks) == 2 and all(a["batch_size"] == 32 for a in attacks)
        rates[label] = attacks[0]["reconstruction_rate"]
        rates[label + "/all"] = attacks[1]["reconstruction_rate"]
        assert all(r.update is not None for r in sent), [r.error for r in sent]
        updates[label] = [r.update for r in sent]
    caches: list[SyntheticCache] = memoised_caches()
    assert len(caches) == 1 and len(caches[0]) == 512  # one audited client, one cache built in its setup
    assert caches[0].stats["accepted"] >= 512
    cache = caches[0]
    flat = cache.images.flatten(1)
    for upd, plain in zip(updates["aegis"], updates["none"], strict=True):  # the ordinary delta, no cache
        assert upd.kind == plain.kind == "delta" and upd.num_samples == plain.num_samples == 32
        assert upd.metadata == plain.metadata  # same keys and values (client id, local steps)
        assert {n: t.shape for n, t in upd.tensors.items()} == {n: t.shape for n, t in plain.tensors.items()}
        assert not torch.allclose(upd.flat(), plain.flat())  # the synthetic step did happen
        for t in upd.tensors.values():
            if t.dim() == 2 and t.shape[1] == flat.shape[1]:  # e.g. the imprint layer's rows
                assert torch.cdist(t, flat).min() > 1e-3
    assert rates["none"] >= 0.6, rates
    assert rates["aegis"] <= 0.5 * rates["none"], rates
    assert rates["aegis/all"] <= 0.5 * rates["none/all"], rates
    clear_cache_memo()


def test_a_plugin_generator_gets_its_options_from_the_aegis_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51 defect: a plugin's generator could only run at its defaults. Its options now come from
    Aegis' ``options`` table, validated against the config class it registered (before any work), reach
    its factory, and key the memo (other options, another cache)."""
    from dataclasses import dataclass

    from gradleak.defenses.aegis.generators.gaussian import ClassGaussianGenerator, GaussianGeneratorConfig
    from gradleak.registry import GENERATORS

    @dataclass(frozen=True)
    class ShiftConfig:
        components: int = 32

    seen: list[ShiftConfig] = []

    def fit_shift(data, config, *, generator=None, root=None):
        seen.append(config)
        return ClassGaussianGenerator.fit(data, GaussianGeneratorConfig(components=config.components))

    monkeypatch.setattr(GENERATORS, "_entries", dict(GENERATORS._entries))  # undone after the test
    GENERATORS.register("shift", fit_shift, config_cls=ShiftConfig, summary="a plugin's generator")
    share = organ_share(120)
    clear_cache_memo()
    a = cache_from_data(
        share, AegisConfig(generator="shift", options={"components": 4}, cache=CacheConfig(size=32))
    )
    b = cache_from_data(
        share, AegisConfig(generator="shift", options={"components": 8}, cache=CacheConfig(size=32))
    )
    assert [c.components for c in seen] == [4, 8]  # the second is not the first's memo
    assert not torch.equal(a.images, b.images)
    assert AegisConfig(generator="shift").generator_options == ShiftConfig()
    with pytest.raises(Exception, match="unknown option.*'nope'"):
        AegisConfig(generator="shift", options={"nope": 1})
    with pytest.raises(ValueError, match="takes its own table"):
        AegisConfig(generator="gaussian", options={"components": 4})
    clear_cache_memo()

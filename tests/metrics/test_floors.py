"""Null floors (issue 18, item 3): scored exactly like a reconstruction from the server's public data, in
every attack record of a run, and the leakage above them."""

from __future__ import annotations

import pytest
import torch

from gradleak.data import load_dataset
from gradleak.data.base import ImageDataset
from gradleak.experiments import load_config, run_experiment
from gradleak.metrics import score_images
from gradleak.metrics.floors import beyond_floor, null_floors


def test_the_floors_are_the_scores_of_the_class_mean_and_a_random_same_class_image():
    public = load_dataset("pneumoniamnist", "val", limit=300)
    truth = load_dataset("pneumoniamnist", "test", limit=8)
    floors = null_floors(truth, public, torch.Generator().manual_seed(0))
    # the slow obvious reference: the class mean by a loop, scored with the same function
    means = []
    for y in truth.labels.tolist():
        same = [public.images[j] for j in range(len(public)) if int(public.labels[j]) == y]
        means.append(torch.stack(same).mean(0))
    expected = score_images(torch.stack(means), truth.images).to_dict()
    assert floors["floor_class_mean_psnr_mean"] == pytest.approx(expected["psnr_mean"], rel=1e-5)
    assert floors["floor_class_mean_reconstruction_rate"] == pytest.approx(expected["reconstruction_rate"])
    # low-variance chest X-rays: the class mean alone already clears 18 dB for many images
    assert floors["floor_class_mean_psnr_mean"] > 15.0
    assert 0.0 <= floors["floor_random_reconstruction_rate"] <= 1.0
    again = null_floors(truth, public, torch.Generator().manual_seed(0))
    assert again == floors  # seeded


def test_a_random_floor_image_has_the_true_images_class():
    public = ImageDataset("p", torch.stack([torch.full((1, 12, 12), v) for v in (0.1, 0.2, 0.8, 0.9)]),
                          torch.tensor([0, 0, 1, 1]), 2)  # fmt: skip
    truth = ImageDataset("t", torch.full((2, 1, 12, 12), 0.85), torch.tensor([1, 1]), 2)
    floors = null_floors(truth, public, torch.Generator().manual_seed(1))
    # class 1's public images are 0.8 and 0.9: 0.05 from the truth, PSNR 26.0 dB; class 0's would be < 17 dB
    assert floors["floor_random_psnr_mean"] == pytest.approx(
        10 * torch.log10(torch.tensor(1 / 0.05**2)).item(), abs=1e-3
    )
    assert floors["floor_class_mean_psnr_mean"] > 60  # class 1's mean is the truth itself


def test_leakage_is_the_score_above_the_higher_floor():
    record = {"psnr_mean": 30.0, "floor_class_mean_psnr_mean": 21.0, "floor_random_psnr_mean": 18.0,
              "reconstruction_rate": 0.5, "floor_class_mean_reconstruction_rate": 0.75,
              "floor_random_reconstruction_rate": 0.25}  # fmt: skip
    assert beyond_floor(record) == {"psnr_mean_beyond_floor": 9.0, "reconstruction_rate_beyond_floor": -0.25}


def test_every_attack_record_of_a_run_carries_its_floors():
    from gradleak.cli.demo import demo_config_path

    cfg = load_config(demo_config_path(), ["data.train_limit=600", "data.test_limit=300", "fl.rounds=1",
                                           "audit.attacks.0.max_iterations=3", "data.num_clients=10",
                                           "fl.fraction=0.2", "audit.clients=2"])  # fmt: skip
    out = run_experiment(cfg)
    records = out.of_kind("attack")
    assert len(records) == 2
    for r in records:
        for key in ("floor_class_mean_psnr_mean", "floor_random_psnr_mean", "psnr_mean_beyond_floor"):
            assert isinstance(r[key], float), key
        top = max(r["floor_class_mean_psnr_mean"], r["floor_random_psnr_mean"])
        assert r["psnr_mean_beyond_floor"] == pytest.approx(r["psnr_mean"] - top)

"""The ``device`` path (gradleak/device.py): one config key, refused before work where the machine lacks
it, nothing in src/ naming a GPU itself, and training, defenses and attacks giving on a device what they
give on the CPU.

On this machine the device-parametrised tests run on the CPU only. ``GRADLEAK_TEST_DEVICES=cuda`` adds a
GPU (scripts/gpu_check.sh, run when a GPU machine is lent): each result computed there is then compared with
the CPU's, to the stated tolerances (GPU kernels round differently; cuDNN may use TF32 in convolutions).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

from gradleak.attacks import create_attack
from gradleak.audit.pipeline import attack_device, attack_update, on_attack_device
from gradleak.defenses.in_loop import build_defenses
from gradleak.device import DeviceError, module_device, parse_device, usable_device
from gradleak.experiments import load_config, run_experiment
from gradleak.experiments.config import ConfigError
from gradleak.models import build_model
from gradleak.registry import ATTACKS, MODELS, Registry
from gradleak.spec import ComponentSpec
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining, Observation, Update
from synthetic import synthetic_dataset

SRC = Path(__file__).resolve().parents[2] / "src" / "gradleak"
EXTRA = [d for d in os.environ.get("GRADLEAK_TEST_DEVICES", "").split(",") if d]
DEVICES = ["cpu", *EXTRA]
SHAPE, CLASSES = (3, 16, 16), 4


# ------------------------------------------------------------------------------------------- the config key
@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:1", " cpu "])
def test_device_names_parse(name):
    assert parse_device(name).type in ("cpu", "cuda")


@pytest.mark.parametrize("name", ["gpu", "tpu", "cuda:x", "", 0, None, "meta"])
def test_a_malformed_device_is_named_in_the_error(name):
    with pytest.raises(DeviceError, match="experiment.device must be 'cpu', 'cuda'"):
        parse_device(name, "experiment.device")


def test_the_config_validates_the_device_on_construction():
    from gradleak.cli.demo import demo_config_path

    with pytest.raises(ConfigError, match="experiment.device"):
        load_config(demo_config_path(), ["experiment.device=gpu"])
    assert load_config(demo_config_path(), ["experiment.device=cuda:0"]).experiment.device == "cuda:0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_an_absent_gpu_is_refused_before_any_data_loads(monkeypatch):
    from gradleak.cli.demo import demo_config_path
    from gradleak.experiments import runner

    def no_work(cfg):
        raise AssertionError("the data loaded before the device was checked")

    monkeypatch.setattr(runner, "build_setup", no_work)
    cfg = load_config(demo_config_path(), ["experiment.device=cuda"])
    with pytest.raises(ConfigError, match="experiment.device 'cuda': torch sees no CUDA device"):
        run_experiment(cfg)
    with pytest.raises(DeviceError, match="no CUDA device"):
        usable_device("cuda:3")


def test_an_attack_must_be_registered_for_the_cpu():
    reg: Registry[object] = Registry("attack")
    with pytest.raises(ValueError, match="devices of attack 'x'"):
        reg.register("x", object, devices=("cuda",))
    with pytest.raises(ValueError, match="devices of attack 'y'"):
        reg.register("y", object, devices=("cpu", "tpu"))


# ----------------------------------------------------------------------------------------- the source rule
def _gpu_literals(tree: ast.AST) -> list[int]:
    """Lines that name a GPU: a ``.cuda()`` call, or a string starting "cuda" given to a call."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
            found.append(node.lineno)
        values = [*node.args, *(k.value for k in node.keywords)]
        if any(isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.startswith("cuda")
               for v in values):  # fmt: skip
            found.append(node.lineno)
    return found


def test_the_source_rule_finds_what_it_forbids():
    code = 'm.cuda()\nx.to("cuda")\ntorch.zeros(3, device="cuda:0")\nx.to(device)\ny = "cuda is a word"\n'
    assert _gpu_literals(ast.parse(code)) == [1, 2, 3]


def test_no_source_file_names_a_gpu_itself():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "device.py" and path.parent == SRC:
            continue  # the one place that knows the device types
        lines = _gpu_literals(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(path.relative_to(SRC))] = lines
    assert offenders == {}


# ------------------------------------------------------------------------------------------- moving whole
def test_an_observation_moves_whole_and_stays_put_where_it_is():
    net = build_model("resnet18", SHAPE, CLASSES, seed=0, width=4)
    tensors = {n: torch.ones_like(p) for n, p in net.named_parameters()}
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    update = Update(tensors, 2, "delta", buffers=buffers)
    obs = Observation(net, update, SHAPE, CLASSES, labels=torch.tensor([0, 1]), views=(update,))
    assert obs.to("cpu") is obs and update.to("cpu") is update
    moved = obs.to("meta")
    assert module_device(moved.model).type == "meta" and module_device(obs.model).type == "cpu"
    for u in (moved.update, *moved.views):
        assert {t.device.type for t in (*u.tensors.values(), *u.buffers.values())} == {"meta"}
    assert moved.labels is not None and moved.labels.device.type == "meta"


def test_an_attack_registered_for_the_cpu_only_gets_a_cpu_copy(monkeypatch):
    device_ready = {n for n in ATTACKS.names() if "cuda" in ATTACKS.entry(n).devices}
    assert device_ready == set(ATTACK_CASES)  # each device-ready attack is compared with the CPU below
    cpu_only = next(n for n in ATTACKS.names() if "cuda" not in ATTACKS.entry(n).devices)
    net = build_model("lenet", (1, 12, 12), 3, seed=0)
    update = Update({n: torch.zeros_like(p) for n, p in net.named_parameters()}, 1)
    obs = Observation(net, update, (1, 12, 12), 3)
    assert on_attack_device("ig", obs) is obs and on_attack_device(cpu_only, obs) is obs  # no copy
    from gradleak.audit import pipeline

    monkeypatch.setattr(pipeline, "module_device", lambda model: torch.device("cuda", 0))  # a GPU model
    assert attack_device("ig", net) == torch.device("cuda", 0)
    assert attack_device(cpu_only, net) == torch.device("cpu")


# ------------------------------------------------------------------------ the same results on every device
def _batch():
    return synthetic_dataset(n=4, shape=SHAPE, classes=CLASSES, seed=3)


def _train(device: str, defenses=(), protocol="fedavg", norm="batch"):
    """A ResNet-18 (width 4) client's update on ``device``; ``defenses`` as (name, options) pairs."""
    net = build_model("resnet18", SHAPE, CLASSES, seed=0, width=4, norm=norm).to(device)
    training = LocalTraining(protocol, epochs=2, batch_size=2, lr=0.05)
    built = build_defenses([(name, dict(options)) for name, options in defenses])
    return net, train_client(0, net, _batch(), training, built, torch.Generator().manual_seed(7))


# defenses that draw from the client's CPU generator give the same update on every device (to rounding)
SAME_DRAWS = [
    (),
    (("batch_noise", {}),),
    (("outpost", {}),),
    (("update_noise", {}),),
    (("pruning", {}),),
    (("compression", {}),),
    (("soteria", {"consumer": "fc"}),),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("defenses", SAME_DRAWS, ids=[d[0][0] if d else "none" for d in SAME_DRAWS])
def test_client_training_on_a_device_matches_the_cpu(device, defenses):
    _, ref = _train("cpu", defenses)
    _, got = _train(device, defenses)
    assert ref.update is not None and got.update is not None, (ref.error, got.error)
    for name, t in got.update.tensors.items():
        assert t.device.type == "cpu"  # updates rest on the CPU
        torch.testing.assert_close(t, ref.update.tensors[name], rtol=1e-3, atol=1e-5)
    for name, b in got.update.buffers.items():
        torch.testing.assert_close(b, ref.update.buffers[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_dp_sgd_trains_on_a_device_with_its_noise_drawn_there(device):
    _, got = _train(device, (("dp_sgd", {"sample_rate": 0.5}),), norm="group")  # Opacus: no BatchNorm
    assert got.update is not None, got.error
    assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in got.update.tensors.values())


ATTACK_CASES = {  # each device-ready image attack, a few iterations, on the update it inverts
    "ig": ("fedsgd", {"max_iterations": 3}),
    "ig_masked": ("fedsgd", {"max_iterations": 3}),
    "ig_noise": ("fedsgd", {"max_iterations": 3, "noise_std": 0.01}),
    "ig_bn": ("fedavg", {"max_iterations": 3}),
    "gradinversion": ("fedsgd", {"max_iterations": 3, "group": 2}),
    "label_counts": ("fedsgd", {}),
    "dlg": ("fedsgd", {"max_iterations": 2, "lbfgs_max_iter": 2}),
    "gi_nas": ("fedsgd", {"max_iterations": 3, "candidates": 2, "width": 16}),
    "sme": ("fedavg", {"max_iterations": 3}),
    "nlsme": ("fedavg", {"max_iterations": 3}),
    "pisme": ("fedavg", {"max_iterations": 3, "nodes": 2}),
}


def _attack_record(attack: str, device: str):
    protocol, options = ATTACK_CASES[attack]
    net, result = _train("cpu", protocol=protocol)
    assert result.update is not None
    training = LocalTraining(protocol, epochs=2, batch_size=2, lr=0.05)
    obs = Observation(net.to(device), result.update, SHAPE, CLASSES, training=training)
    spec = ComponentSpec(attack, options)
    return attack_update(
        create_attack(attack, **options), spec, obs, generator=torch.Generator().manual_seed(1)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attack", sorted(ATTACK_CASES))
def test_an_attack_on_a_device_matches_the_cpu(attack, device):
    ref, got = _attack_record(attack, "cpu"), _attack_record(attack, device)
    assert got.record["kind"] == "attack" and got.record["refused"] is None, got.record
    assert ref.reconstruction is not None and got.reconstruction is not None
    images, labels = got.reconstruction.images, got.reconstruction.labels
    assert labels is not None and labels.device.type == "cpu"  # results rest on the CPU
    assert torch.equal(labels, ref.reconstruction.labels)
    if images is None:  # a label attack: its labels are all it returns
        return
    assert images.device.type == "cpu"
    # a few signed-gradient steps: rounding can flip a near-zero sign, moving a pixel by one step (lr)
    assert float((images - ref.reconstruction.images).abs().mean()) <= (0.0 if device == "cpu" else 0.05)
    assert got.record["matching_loss"] == pytest.approx(
        ref.record["matching_loss"], rel=0 if device == "cpu" else 0.05
    )


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_on_a_device_gives_the_cpu_run_s_records(device):
    from gradleak.cli.demo import demo_config_path

    tiny = [
        "data.dataset='cifar10'",
        "data.train_split='test'",
        "data.train_limit=300",
        "data.test_limit=100",
        "data.num_clients=6",
        "model.name='resnet18'",
        "model.options={width = 4}",
        "fl.rounds=1",
        "fl.fraction=0.34",
        "audit.attacks.0.max_iterations=5",
        "audit.training.batch_size=2",
        "audit.clients=1",
    ]  # fmt: skip  (a BatchNorm ResNet on CIFAR-10: the data the GPU check carries)
    ref = run_experiment(load_config(demo_config_path(), tiny))
    got = run_experiment(load_config(demo_config_path(), [*tiny, f"experiment.device={device}"]))
    (a,), (b,) = ref.of_kind("attack"), got.of_kind("attack")
    assert b["psnr_mean"] == pytest.approx(a["psnr_mean"], abs=0.0 if device == "cpu" else 0.5)
    ra, rb = ref.of_kind("round")[0], got.of_kind("round")[0]
    assert rb["accuracy"] == pytest.approx(ra["accuracy"], abs=0.0 if device == "cpu" else 0.02)


def test_every_image_model_builds_and_trains_through_the_device_path():
    for name in MODELS.names():
        if MODELS.entry(name).modality not in (None, "image"):
            continue
        net = build_model(name, SHAPE, CLASSES, seed=0)
        result = train_client(0, net.to("cpu"), _batch(), LocalTraining("fedsgd", batch_size=2), [],
                              torch.Generator().manual_seed(0))  # fmt: skip
        assert result.update is not None and result.update.num_samples == 2, (name, result.error)

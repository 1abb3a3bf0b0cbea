"""The one validation point for updates: random update dicts are never accepted when invalid, every path an
update takes (client, server, Observation, file) applies it, and the errors name the source and tensor."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from gradleak.federation import FederatedSimulation, FLConfig, screen, train_client
from gradleak.tasks.client import ClientResult
from gradleak.types import AttackInputError, LocalTraining, Observation, Update
from gradleak.update_io import load_update, save_update
from gradleak.validation import InvalidUpdateError, check_update, error_text


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3))


MODEL = small_model()
REFERENCE = dict(MODEL.named_parameters())
NAMES = list(REFERENCE)

# one mutation an attacker or a broken client could send, or none
MUTATIONS = ("none", "drop", "extra", "shape", "int", "half", "double", "nan", "posinf", "neginf",
             "not_tensor", "bad_key")  # fmt: skip


def mutated(kind: str, target: int, seed: int) -> dict[object, object]:
    """A valid update's tensors with one ``kind`` of fault at parameter ``target`` (or none)."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[object, object] = {n: torch.randn(p.shape, generator=g) for n, p in REFERENCE.items()}
    name = NAMES[target % len(NAMES)]
    t = tensors[name]
    assert isinstance(t, torch.Tensor)
    flat_index = seed % t.numel()
    if kind == "drop":
        del tensors[name]
    elif kind == "extra":
        tensors["backdoor.weight"] = torch.zeros(2)
    elif kind == "shape":
        tensors[name] = torch.zeros(t.numel() + 1)
    elif kind == "int":
        tensors[name] = t.to(torch.int64)
    elif kind == "half":  # mixed precision would overflow the aggregate
        tensors[name] = t.to(torch.float16)
    elif kind == "double":
        tensors[name] = t.to(torch.float64)
    elif kind in ("nan", "posinf", "neginf"):
        value = {"nan": math.nan, "posinf": math.inf, "neginf": -math.inf}[kind]
        t.view(-1)[flat_index] = value
    elif kind == "not_tensor":
        tensors[name] = t.tolist()
    elif kind == "bad_key":
        tensors[7] = tensors.pop(name)
    return tensors


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(MUTATIONS), target=st.integers(0, 100), seed=st.integers(0, 2**31 - 1))
def test_random_update_dicts_are_accepted_exactly_when_valid(kind, target, seed):
    tensors = mutated(kind, target, seed)
    update = Update.__new__(Update)  # field by field: Update's constructor refuses some faults itself
    object.__setattr__(update, "tensors", tensors)
    object.__setattr__(update, "num_samples", 4)
    object.__setattr__(update, "kind", "delta")
    object.__setattr__(update, "metadata", {"client_id": 9})
    object.__setattr__(update, "buffers", {})
    if kind == "none":
        check_update(update, MODEL, source="client 9")
        return
    with pytest.raises(InvalidUpdateError) as err:
        check_update(update, MODEL, source="client 9")
    message = str(err.value)
    assert message.startswith("client 9: ")
    if kind not in ("extra", "bad_key"):  # the offending tensor is named
        assert NAMES[target % len(NAMES)] in message


@pytest.mark.parametrize("samples", [-1, 2.5, True, "4"])
def test_a_bad_sample_count_is_rejected(samples):
    update = Update.__new__(Update)
    for key, value in (("tensors", mutated("none", 0, 0)), ("num_samples", samples), ("kind", "delta"),
                       ("metadata", {}), ("buffers", {})):  # fmt: skip
        object.__setattr__(update, key, value)
    with pytest.raises(InvalidUpdateError, match="num_samples"):
        check_update(update, MODEL)


def _update(kind: str = "none", seed: int = 0, client: int = 3) -> Update:
    tensors = mutated(kind, 1, seed)
    return Update(tensors, 4, "delta", {"client_id": client})  # type: ignore[arg-type]


def test_an_attack_refuses_a_non_finite_observation_naming_the_tensor():
    with pytest.raises(AttackInputError, match=r"client 3: tensor '1.bias' has 1 non-finite"):
        Observation(MODEL, _update("nan"), (1, 3, 4), 3)
    with pytest.raises(AttackInputError, match="input_shape"):
        Observation(MODEL, _update(), (0, 3), 3)
    frozen = {
        n: t for n, t in _update().tensors.items() if n != "1.weight"
    }  # frozen parameters may be absent
    Observation(MODEL, Update(frozen, 4), (1, 3, 4), 3)


def test_a_wrong_input_shape_is_an_attack_input_error_not_a_torch_error():
    from gradleak.attacks import create_attack
    from gradleak.models import build_model

    model = build_model("aegis_cnn", (1, 28, 28), 11, seed=0)
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    obs = Observation(model, Update(grads, 2, "gradient"), (3, 32, 32), 11)
    for name in ("ig", "dlg", "sme"):
        with pytest.raises(AttackInputError, match=r"input_shape \(3, 32, 32\)"):
            create_attack(name, max_iterations=1).reconstruct(obs, generator=torch.Generator())


def test_the_server_drops_an_invalid_update_and_keeps_the_others():
    good = ClientResult(1, _update(client=1))
    bad = ClientResult(2, _update("posinf", client=2))
    out = screen([good, bad], MODEL, round_idx=5, kind="delta")
    assert out[0] is good and out[1].update is None and out[1].client_id == 2
    assert out[1].error is not None and "client 2, round 5: tensor '1.bias'" in out[1].error
    gradient = ClientResult(3, Update(dict(_update().tensors), 4, "gradient"))
    empty = ClientResult(4, Update(dict(_update().tensors), 0, "delta"))
    half = ClientResult(5, Update(mutated("half", 0, 1), 4, "delta"))  # type: ignore[arg-type]
    out = screen([good, gradient, empty, half], MODEL, round_idx=0, kind="delta")
    assert [r.update is not None for r in out] == [True, False, False, False]
    assert "a 'gradient' update in a round of 'delta' updates" in str(out[1].error)
    assert "reports 0 samples" in str(out[2].error) and "dtype torch.float16" in str(out[3].error)


def test_a_client_without_defenses_withholds_a_diverged_update(tiny_data):
    from gradleak.models import build_model

    model = build_model("lenet", tiny_data.input_shape, tiny_data.num_classes, seed=0)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = math.nan  # a diverged global model: every update is NaN
    training = LocalTraining("fedavg", epochs=1, batch_size=8, lr=0.1)
    res = train_client(4, model, tiny_data, training, [], torch.Generator().manual_seed(0))
    assert (
        res.update is None and res.error is not None and "client 4" in res.error and "non-finite" in res.error
    )


def test_a_round_with_an_update_corrupted_in_transit_aggregates_the_others(tiny_data):
    from gradleak.federation import InProcessEngine
    from gradleak.models import build_model

    class Corrupting(InProcessEngine):
        """Clients check what they send; client 1's upload is corrupted on the way to the server."""

        def train_clients(self, global_model, tasks, defenses):
            results = super().train_clients(global_model, tasks, defenses)
            for r in results:
                if r.client_id == 1 and r.update is not None:
                    poisoned = {n: t.clone().fill_(math.nan) for n, t in r.update.tensors.items()}
                    r.update = r.update.replace(poisoned)
            return results

    model = build_model("lenet", tiny_data.input_shape, tiny_data.num_classes, seed=0)
    clients = [tiny_data.subset(range(i * 8, i * 8 + 8)) for i in range(3)]
    cfg = FLConfig(rounds=1, fraction=1.0, training=LocalTraining("fedavg", epochs=1, batch_size=8, lr=0.01))
    sim = FederatedSimulation(model, clients, cfg, seed=0, engine=Corrupting())
    rr = sim.run_round(0)
    assert rr.dropped == [1] and "rejected by the server" in rr.errors[1] and "round 0" in rr.errors[1]
    assert all(bool(torch.isfinite(p).all()) for p in sim.model.parameters())
    assert rr.aggregate is not None and rr.aggregate.num_samples == 16  # the two valid clients


def test_updates_round_trip_through_safetensors_files_and_foreign_files_are_refused(tmp_path):
    update = _update(seed=4)
    path = save_update(update, tmp_path / "u.safetensors")
    back = load_update(path, MODEL)
    assert back.kind == "delta" and back.num_samples == 4 and dict(back.metadata) == {"client_id": 3}
    assert all(torch.equal(back.tensors[n], update.tensors[n]) for n in NAMES)
    pickled = tmp_path / "u.pt"
    torch.save(dict(update.tensors), pickled)
    with pytest.raises(InvalidUpdateError, match="not a safetensors file"):
        load_update(pickled, MODEL)
    nan_path = save_update(Update(mutated("nan", 2, 1), 4), tmp_path / "nan.safetensors")  # type: ignore[arg-type]
    with pytest.raises(InvalidUpdateError, match=r"update file .*nan.safetensors: tensor '3.weight'"):
        load_update(nan_path, MODEL)
    other = nn.Linear(2, 2)
    with pytest.raises(InvalidUpdateError, match="parameters the model lacks"):
        load_update(path, other)


def test_an_update_built_from_a_list_of_tensors_is_refused_with_a_clear_message():
    with pytest.raises(TypeError, match="map parameter names to tensors"):
        Update([p.detach() for p in MODEL.parameters()], 4)  # type: ignore[arg-type]


def test_an_update_file_keeps_the_reply_s_batchnorm_statistics_and_checks_them(tmp_path):
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    tensors = {
        n: torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) for n, p in net.named_parameters()
    }
    buffers = {n: b.clone() + 1 for n, b in net.named_buffers()}
    update = Update(tensors, 3, "delta", {"client_id": 1}, buffers)
    back = load_update(save_update(update, tmp_path / "bn.safetensors"), net)
    assert set(back.tensors) == set(tensors) and set(back.buffers) == set(buffers)
    assert all(
        torch.equal(back.buffers[n], b) and back.buffers[n].dtype == b.dtype for n, b in buffers.items()
    )
    bad = dict(buffers, **{"1.running_var": torch.full((2,), float("nan"))})
    path = save_update(Update(tensors, 3, "delta", {}, bad), tmp_path / "nan.safetensors")
    with pytest.raises(InvalidUpdateError, match="running_var"):
        load_update(path, net)


def test_a_model_with_frozen_parameters_takes_full_and_trainable_only_updates():
    """A complete update carries every trainable parameter; a frozen one may come (zeros) or not."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net[0].requires_grad_(False)
    full = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    check_update(Update(full, 1), net)
    check_update(Update({k: v for k, v in full.items() if k.startswith("1.")}, 1), net)
    with pytest.raises(InvalidUpdateError, match=r"lacks parameters of the model: \['1.bias'\]"):
        check_update(Update({k: v for k, v in full.items() if k != "1.bias"}, 1), net)


def test_batchnorm_statistics_must_be_possible_values():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    tensors = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    check_update(Update(tensors, 1, "delta", {}, buffers), net)
    negative = dict(buffers, **{"1.running_var": torch.tensor([1.0, -0.5])})
    with pytest.raises(InvalidUpdateError, match="'1.running_var' holds a negative variance"):
        check_update(Update(tensors, 1, "delta", {}, negative), net)
    net[1].num_batches_tracked.fill_(5)  # the server's model has counted 5 steps; a reply says 3
    with pytest.raises(InvalidUpdateError, match="counter '1.num_batches_tracked' went back"):
        check_update(
            Update(tensors, 1, "delta", {}, dict(buffers, **{"1.num_batches_tracked": torch.tensor(3)})), net
        )


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=0, max_size=1500), limit=st.integers(min_value=100, max_value=1000))
def test_an_error_text_is_bounded_and_keeps_its_head_and_its_last_line(text: str, limit: int) -> None:
    """A record keeps at most ``limit`` characters of an error; a longer one keeps its start and its end,
    where a traceback names the error (a Ray actor's trace once put ``IndexError: ... out of bounds`` past
    a 2000-character head cut)."""
    out = error_text(text, limit)
    if len(text) <= limit:
        assert out == text
        return
    assert len(out) == limit
    head, rest = out.split("\n[... ", 1)
    count, tail = rest.split(" characters left out ...]\n", 1)
    assert text.startswith(head) and text.endswith(tail)
    assert int(count) == len(text) - len(head) - len(tail)  # the characters really left out


def test_an_exception_is_recorded_with_its_type() -> None:
    assert error_text(IndexError("Target 11 is out of bounds.")) == "IndexError: Target 11 is out of bounds."

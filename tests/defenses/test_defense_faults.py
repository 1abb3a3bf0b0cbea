"""Fault injection: an exception or a non-finite value injected into any hook of any image defense, at any
step, never lets an update out (fail closed), over 100 seeded trials per defense."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from gradleak.defenses.aegis.cache import SyntheticCache
from gradleak.defenses.aegis.defense import aegis_for_client
from gradleak.defenses.base import Defense
from gradleak.models import build_model
from gradleak.registry import DEFENSES
from gradleak.tasks.client import train_client
from gradleak.types import LocalTraining
from synthetic import synthetic_dataset

SHAPE = (1, 12, 12)
HOOKS = ("setup", "on_gradients", "on_epoch_end", "on_update")
FAULTS = ("raise", "nan", "inf")
TRIALS = 100


def make_defense(name: str) -> Defense:
    """Each image defense with options that keep a trial to a few milliseconds."""
    if name == "aegis":
        cache = synthetic_dataset(n=8, shape=SHAPE, classes=3, seed=7)
        return aegis_for_client(SyntheticCache(cache.images, cache.labels), cache={"size": 8}, micro_batch=8)
    options = {"soteria": {"consumer": "classifier.3", "probes": 2}, "batch_noise": {"batch_size": 8}}
    defense: Defense = DEFENSES.create(name, **options.get(name, {}))
    return defense


IMAGE_DEFENSES = sorted(e.name for e in DEFENSES if e.modality != "text")


def _poison(value: float, model: torch.nn.Module, *, grads: bool) -> None:
    """Fill the first trainable parameter (or its gradient) with ``value``: a whole tensor, so that the
    forward pass meets it whichever inputs come (one entry of an embedding row no token uses would not)."""
    with torch.no_grad():
        p = next(p for p in model.parameters() if p.requires_grad)
        target = p.grad if grads and p.grad is not None else p
        target.fill_(value)


def inject(defense: Defense, hook: str, fault: str, at_call: int) -> dict[str, int]:
    """Wrap ``defense.<hook>`` so that its ``at_call``-th call (after running) raises or corrupts."""
    original = getattr(defense, hook)
    state = {"calls": 0, "fired": 0}
    value = math.nan if fault == "nan" else math.inf

    @functools.wraps(original)  # keeps the signature: a data-aware setup still receives the client's data
    def hooked(*args, **kwargs):
        out = original(*args, **kwargs)
        state["calls"] += 1
        if state["calls"] - 1 != at_call:
            return out
        state["fired"] += 1
        if fault == "raise":
            raise RuntimeError(f"injected fault in {hook}")
        if hook == "on_update":
            return out.replace({n: t.clone().fill_(value) if i == 0 else t for i, (n, t) in
                                enumerate(out.tensors.items())})  # fmt: skip
        model = args[0]
        _poison(value, model, grads=hook == "on_gradients")
        return out

    setattr(defense, hook, hooked)
    return state


@pytest.mark.parametrize("name", IMAGE_DEFENSES)
def test_a_fault_in_any_hook_lets_no_update_out(name):
    assert {"aegis", "compression", "batch_noise", "pruning", "soteria"} <= set(IMAGE_DEFENSES)
    data = synthetic_dataset(n=16, shape=SHAPE, classes=3, seed=1)
    model = build_model("aegis_cnn", SHAPE, 3, seed=0)
    rng = np.random.default_rng(0)
    calls = {"setup": 1, "on_gradients": 4, "on_epoch_end": 2, "on_update": 1}  # 2 epochs x 2 batches
    fedsgd = LocalTraining("fedsgd", batch_size=8)
    sgd_ok = train_client(0, model, data, fedsgd, [make_defense(name)], torch.Generator()).update is not None
    outcomes = []
    for trial in range(TRIALS):
        hook, fault = HOOKS[rng.integers(len(HOOKS))], FAULTS[rng.integers(len(FAULTS))]
        use_sgd = sgd_ok and hook != "on_epoch_end" and rng.random() < 0.3  # Aegis is FedAvg-only
        protocol = "fedsgd" if use_sgd else "fedavg"
        n_calls = 1 if protocol == "fedsgd" and hook == "on_gradients" else calls[hook]
        at = int(rng.integers(n_calls))
        defense = make_defense(name)
        state = inject(defense, hook, fault, at)
        training = LocalTraining(protocol, epochs=2, batch_size=8, lr=0.01, optimizer="adam")
        res = train_client(trial, model, data, training, [defense], torch.Generator().manual_seed(trial))
        assert state["fired"] == 1, (trial, hook, protocol, at, state)  # the fault really happened
        outcomes.append((hook, fault, res.update is None))
        assert res.update is None, (name, trial, hook, fault, at, protocol)
        assert res.error and (name in res.error or "non-finite" in res.error), res.error
    assert len(outcomes) == TRIALS and {h for h, _, _ in outcomes} == set(HOOKS)
    clean = train_client(0, model, data, LocalTraining("fedavg", epochs=2, batch_size=8, lr=0.01),
                         [make_defense(name)], torch.Generator().manual_seed(0))  # fmt: skip
    assert clean.update is not None  # without a fault the same client does send


# aegis_llm (text only) gets the full 100 trials; the modality-agnostic defenses had theirs on the image
# client above, here 25 each check the text client's own loops (top-k over a 50k-token embedding is slow)
TEXT_TRIALS = {"aegis_llm": TRIALS, "compression": 25, "batch_noise": 25, "pruning": 25}


@pytest.mark.parametrize("name", sorted(TEXT_TRIALS))
def test_a_fault_in_any_hook_of_a_text_client_lets_no_update_out(name):
    """The text client's loops (FedSGD gradient, FedAvg with LocalTrainer) raise instead of sending."""
    from gradleak.data.text import encode
    from gradleak.defenses.base import DefenseFailure
    from gradleak.models.text import build_gpt2
    from gradleak.tasks.text_client import fedavg_text_update, fedsgd_text_update
    from gradleak.validation import InvalidUpdateError

    tm = build_gpt2("tiny", "classification", seed=0)
    batches = [encode(["the movie was good", "a dull film ."], tm.tokenizer, labels=[1, 0]) for _ in range(2)]
    rng = np.random.default_rng(1)
    calls = {"setup": 1, "on_gradients": 4, "on_epoch_end": 2, "on_update": 1}  # 2 epochs x 2 batches
    for trial in range(TEXT_TRIALS[name]):
        hook, fault = HOOKS[rng.integers(len(HOOKS))], FAULTS[rng.integers(len(FAULTS))]
        sgd = hook != "on_epoch_end" and rng.random() < 0.3
        at = 0 if sgd else int(rng.integers(calls[hook]))
        defense: Defense = DEFENSES.create(name)
        state = inject(defense, hook, fault, at)
        gen = torch.Generator().manual_seed(trial)
        with pytest.raises((DefenseFailure, InvalidUpdateError)):
            if sgd:
                fedsgd_text_update(tm.model, batches[0], "classification", defenses=[defense], generator=gen)
            else:
                fedavg_text_update(tm.model, batches, "classification", lr=0.01, epochs=2,
                                   defenses=[defense], generator=gen)  # fmt: skip
        assert state["fired"] == 1, (trial, hook, sgd, at)
    update = fedavg_text_update(
        tm.model, batches, "classification", epochs=2, defenses=[DEFENSES.create(name)]
    )
    assert update is not None  # without a fault the same client does send

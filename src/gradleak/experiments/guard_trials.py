"""Measuring the client's guard (:mod:`gradleak.defenses.guard`): false alarms and detection.

One trial is one federation (a data set, a model, a seed) trained by real FedAvg
(:class:`~gradleak.federation.simulation.FederatedSimulation`, every client every round, Dirichlet non-IID
partition). Before each round every client's guard checks the global model the server broadcasts, on a
probe of the client's own data, and remembers what it accepted (the ``drift`` reference): an alarm on an
honest model is a false alarm. At the checkpoints (the initial model, mid-training, the end) a malicious
server instead turns the current global model into each attack of :mod:`gradleak.attacks.linear.in_place`
(LOKI customised per client) and each client's guard inspects its copy without remembering it: a refusal
is a detection. The attacks are also run (FedSGD on a batch of client 0's data) where they recover
images (the first linear layer reads the pixels), at the first checkpoint, so that the malicious models
counted are shown to leak; class fishing fishes a class client 0 holds (the server's best case).

Rates come with exact (Clopper-Pearson) 95 % bounds: the false-alarm rate's upper bound, the detection
rate's lower bound.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from scipy.stats import beta
from tqdm import tqdm

from gradleak.attacks import create_attack
from gradleak.data import load_dataset
from gradleak.data.base import ImageDataset
from gradleak.data.partition import partition
from gradleak.defenses.guard import GuardConfig, GuardVerdict, ModelGuard, relative_change
from gradleak.federation.simulation import FederatedSimulation, FLConfig, derive_seed
from gradleak.metrics.image import match_reconstructions, pairwise_psnr
from gradleak.models import build_model
from gradleak.registry import ATTACKS as REGISTRY
from gradleak.tasks.client import train_client
from gradleak.types import AttackInputError, ClientCustomizingAttack, LocalTraining, Observation

log = logging.getLogger(__name__)

ATTACKS: dict[str, dict[str, Any]] = {
    "rtf_in_place": {},
    "loki_in_place": {},
    "trap_weights": {},
    "class_fishing": {"inversion": {"max_iterations": 200}},
}
EVASIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "rtf_in_place noise 0.3": ("rtf_in_place", {"noise": 0.3}),
    "rtf_in_place noise 1.0": ("rtf_in_place", {"noise": 1.0}),
    "trap_weights random halves": ("trap_weights", {"exact_half": False}),
}
RECOVERED_DB = 18.0  # a client image counts as recovered above this PSNR (reconstruction_rate's default)


@dataclass(frozen=True)
class GuardSetting:
    """One federation: ``clients`` of ``samples`` images each (Dirichlet ``alpha`` label skew), trained for
    ``rounds`` rounds of FedAvg (1 local epoch, SGD ``lr``, batch 32); the server's public images are
    ``public`` others; the probe is the first ``probe`` images of each client's data. ``trusted_start``:
    the clients know the federation's initial model (a seed or checkpoint agreed beforehand) and guard drift
    from it; otherwise their own model has other weights and the first model is checked without drift."""

    dataset: str
    model: str
    seed: int
    rounds: int = 10
    clients: int = 4
    samples: int = 128
    public: int = 256
    lr: float = 0.05
    alpha: float = 0.5
    probe: int = 64
    batch: int = 16  # the FedSGD batch the attacks are run on
    trusted_start: bool = True


@dataclass
class TrialResult:
    """Counts of one trial. ``honest``: models checked, models on which any client raised an alarm;
    ``checks_fired``: which check raised each false alarm; ``attacks``: per attack, the clients' copies
    checked and refused, the checks that fired, and the share of the client's batch each attack recovered
    (where it recovers images); ``max_drift``: the largest honest per-round layer change seen."""

    setting: GuardSetting
    honest_models: int = 0
    honest_alarms: int = 0
    client_checks: int = 0
    client_alarms: int = 0
    checks_fired: Counter[str] = field(default_factory=Counter)
    attacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_drift: float = 0.0
    accuracy: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.setting.dataset,
            "model": self.setting.model,
            "seed": self.setting.seed,
            "honest_models": self.honest_models,
            "honest_alarms": self.honest_alarms,
            "client_checks": self.client_checks,
            "client_alarms": self.client_alarms,
            "checks_fired": dict(self.checks_fired),
            "max_honest_drift": self.max_drift,
            "final_accuracy": self.accuracy,
            "attacks": self.attacks,
        }


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact (Clopper-Pearson) one-sided ``level`` bounds of a binomial rate ``k / n``: the lower bound and
    the upper bound, each holding with probability ``level`` (0 of 300 gives an upper bound of 0.99 %)."""
    if n <= 0:
        return (0.0, 1.0)
    low = 0.0 if k == 0 else float(beta.ppf(1 - level, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(level, k + 1, n - k))
    return low, high


def federation(setting: GuardSetting) -> tuple[FederatedSimulation, list[ImageDataset], torch.Tensor]:
    """The simulation, each client's data and the server's public images."""
    s = setting
    data = load_dataset(s.dataset, limit=s.public + s.clients * s.samples)
    public = data.images[: s.public]
    rest = data.subset(list(range(s.public, len(data.images))))
    parts = partition(
        "dirichlet", rest, s.clients, derive_seed(s.seed, 0xD1), alpha=s.alpha, min_size=s.batch
    )
    clients = [rest.subset(p) for p in parts]
    model = build_model(s.model, tuple(data.images.shape[1:]), data.num_classes, seed=s.seed)
    training = LocalTraining(protocol="fedavg", epochs=1, batch_size=32, lr=s.lr, optimizer="sgd")
    sim = FederatedSimulation(
        model, clients, FLConfig(rounds=s.rounds, fraction=1.0, training=training), seed=s.seed, test=None
    )
    return sim, clients, public


def drift(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], names: Sequence[str]
) -> float:
    """The largest relative change of the named weights from ``before`` to ``after`` (the guard's measure)."""
    return max(relative_change(before[n], after[n]) for n in names)


def recovered_share(
    attack: Any,
    model: torch.nn.Module,
    secrets: Mapping[str, object],
    batch: ImageDataset,
    num_classes: int,
    generator: torch.Generator,
) -> float | None:
    """The share of ``batch`` the attack recovers (PSNR above :data:`RECOVERED_DB`, matched one to one)
    from the FedSGD gradient of ``model`` on it; for class fishing, which recovers one image, 1 when it
    matches a sample of the fished class, else 0; None where the attack recovers features, not images."""
    fedsgd = LocalTraining("fedsgd", batch_size=len(batch.images))  # one gradient on the whole batch
    update = train_client(0, model, batch, fedsgd, [], torch.Generator()).update  # (its order: as given)
    assert update is not None
    obs = Observation(
        model=model, update=update,
        input_shape=tuple(batch.images.shape[1:]), num_classes=num_classes, secrets=secrets,
    )  # fmt: skip
    try:
        rec = attack.reconstruct(obs, generator=generator)
    except AttackInputError:
        return None
    assert rec.images is not None
    if "target_class" in secrets:  # a class fisher: one image of that class, scored against its samples
        truth = batch.images[batch.labels == int(secrets["target_class"])]  # type: ignore[call-overload]
        return float(len(truth) > 0 and float(pairwise_psnr(rec.images, truth).max()) > RECOVERED_DB)
    psnr = pairwise_psnr(rec.images, batch.images)
    perm = match_reconstructions(rec.images, batch.images)
    hits = sum(1 for j, i in enumerate(perm.tolist()) if i >= 0 and float(psnr[i, j]) > RECOVERED_DB)
    return hits / len(batch.images)


def run_trial(
    setting: GuardSetting,
    *,
    config: GuardConfig | None = None,
    attacks: Mapping[str, tuple[str, Mapping[str, Any]]] | None = None,
    checkpoints: Sequence[int] | None = None,
    progress: bool = False,
) -> TrialResult:
    """One federation (module docstring). ``attacks``: label -> (attack name, options), default every
    attack of :data:`ATTACKS` plus the :data:`EVASIONS`; ``checkpoints``: the rounds before which the
    malicious server strikes (default: the first, the middle and after the last)."""
    s = setting
    config = config or GuardConfig()
    attacks = attacks if attacks is not None else {**{a: (a, o) for a, o in ATTACKS.items()}, **EVASIONS}
    checkpoints = checkpoints if checkpoints is not None else sorted({0, s.rounds // 2, s.rounds})
    sim, clients, public = federation(s)
    own_seed = s.seed if s.trusted_start else s.seed + 10_000  # the agreed initial model, or other weights
    c, h, w = public.shape[1:]
    own = build_model(s.model, (c, h, w), clients[0].num_classes, seed=own_seed)
    guards = [ModelGuard(own, config, trusted_start=s.trusted_start) for _ in clients]
    probes = [c.images[: s.probe] for c in clients]
    linears = [f"{n}.weight" for n, m in sim.model.named_modules() if isinstance(m, torch.nn.Linear)]
    result = TrialResult(s, attacks={label: {"checked": 0, "refused": 0, "checks": Counter(), "recovered": []}
                                     for label in attacks})  # fmt: skip
    previous: dict[str, torch.Tensor] | None = None
    for r in tqdm(range(s.rounds + 1), desc=f"guard {s.dataset}/{s.model}/{s.seed}", disable=not progress):
        state = {n: t.detach().clone() for n, t in sim.model.state_dict().items()}
        if previous is not None:
            result.max_drift = max(result.max_drift, drift(previous, state, linears))
        if r in checkpoints:  # the attacks' leakage is measured at the first checkpoint (IG is the cost)
            seed = derive_seed(s.seed, r, 0xA7)
            strike(
                sim.model, clients, public, guards, probes, attacks, result, seed, leak=r == checkpoints[0]
            )
        verdicts = [g.inspect(state, p) for g, p in zip(guards, probes, strict=True)]
        record_honest(result, verdicts)
        previous = state
        if r < s.rounds:
            sim.run_round(r)
    for row in result.attacks.values():
        row["checks"] = dict(row["checks"])
    return result


def record_honest(result: TrialResult, verdicts: Sequence[GuardVerdict]) -> None:
    result.honest_models += 1
    result.client_checks += len(verdicts)
    alarms = [v for v in verdicts if not v.safe]
    result.client_alarms += len(alarms)
    if alarms:
        result.honest_alarms += 1
        for v in alarms:
            result.checks_fired.update({f.check for f in v.findings})
            log.warning("false alarm: %s", v.reason())


def strike(
    model: torch.nn.Module,
    clients: Sequence[ImageDataset],
    public: torch.Tensor,
    guards: Sequence[ModelGuard],
    probes: Sequence[torch.Tensor],
    attacks: Mapping[str, tuple[str, Mapping[str, Any]]],
    result: TrialResult,
    seed: int,
    *,
    leak: bool = True,
) -> None:
    """Every attack turns the current global model malicious; every client's guard inspects its copy."""
    for label, (name, options) in attacks.items():
        config_cls = REGISTRY.entry(name).config_cls
        fishes = config_cls is not None and "target_class" in {f.name for f in dataclasses.fields(config_cls)}
        if fishes and "target_class" not in options:  # the server's best case: a class client 0 holds
            options = {**options, "target_class": int(clients[0].labels[0])}
        attack = create_attack(name, **options)
        generator = torch.Generator().manual_seed(derive_seed(seed, len(label)))
        try:
            malicious, secrets = attack.prepare(copy.deepcopy(model), public, generator=generator)  # type: ignore[attr-defined]
        except AttackInputError as exc:  # e.g. LeNet has no hidden linear layer to write bins into
            result.attacks[label]["not_applicable"] = str(exc)
            continue
        row = result.attacks[label]
        for j, (guard, probe) in enumerate(zip(guards, probes, strict=True)):
            sent = (
                attack.customize(malicious, j) if isinstance(attack, ClientCustomizingAttack) else malicious
            )
            verdict = guard.inspect(sent.state_dict(), probe, remember=False)
            row["checked"] += 1
            row["refused"] += int(not verdict.safe)
            row["checks"].update({f.check for f in verdict.findings})
            if j == 0 and leak:
                batch = clients[0].subset(list(range(min(result.setting.batch, len(clients[0].images)))))
                share = recovered_share(attack, sent, secrets, batch, clients[0].num_classes, generator)
                if share is not None:
                    row["recovered"].append(share)


def summarise(trials: Sequence[TrialResult]) -> dict[str, Any]:
    """Pooled counts and rates with their 95 % bounds, per attack and overall."""
    models = sum(t.honest_models for t in trials)
    alarms = sum(t.honest_alarms for t in trials)
    checks = sum(t.client_checks for t in trials)
    client_alarms = sum(t.client_alarms for t in trials)
    out: dict[str, Any] = {
        "honest": {
            "models_checked": models,
            "models_with_an_alarm": alarms,
            "false_alarm_rate": alarms / max(models, 1),
            "false_alarm_rate_95_upper": clopper_pearson(alarms, models)[1],
            "client_checks": checks,
            "client_alarms": client_alarms,
            "client_false_alarm_rate_95_upper": clopper_pearson(client_alarms, checks)[1],
            "max_honest_drift": max((t.max_drift for t in trials), default=0.0),
            "checks_fired": dict(sum((t.checks_fired for t in trials), Counter())),
        },
        "attacks": {},
    }
    labels = dict.fromkeys(label for t in trials for label in t.attacks)
    for label in labels:
        rows = [t.attacks[label] for t in trials if label in t.attacks]
        checked = sum(r["checked"] for r in rows)
        refused = sum(r["refused"] for r in rows)
        fired: Counter[str] = Counter()
        for r in rows:
            fired.update(r["checks"])
        recovered = [x for r in rows for x in r["recovered"]]
        out["attacks"][label] = {
            "checked": checked,
            "refused": refused,
            "detection_rate": refused / max(checked, 1),
            "detection_rate_95_lower": clopper_pearson(refused, checked)[0],
            "checks_fired": dict(fired),
            "settings_not_applicable": sum(1 for r in rows if "not_applicable" in r),
            "mean_share_recovered": sum(recovered) / len(recovered) if recovered else None,
            "runs_scored": len(recovered),
        }
    return out


__all__ = ["ATTACKS", "EVASIONS", "GuardSetting", "TrialResult", "clopper_pearson", "run_trial", "summarise"]

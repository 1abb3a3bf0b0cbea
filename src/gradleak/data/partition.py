"""Split a dataset among federated clients: IID, label skew, Dirichlet and natural (per writer).

Every partitioner returns ``list[np.ndarray]``: one sorted int64 array of sample indices per client, and
takes an explicit ``rng`` (a ``np.random.Generator`` or an int seed), so equal seeds give equal partitions.
No global random state is used. :func:`partition` runs one by name on an :class:`ImageDataset`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gradleak.data.base import ImageDataset
from gradleak.registry import PARTITIONERS, UnknownNameError

logger = logging.getLogger(__name__)

RngLike = np.random.Generator | int
ArrayLike = np.ndarray | torch.Tensor


def as_rng(rng: RngLike) -> np.random.Generator:
    """A Generator as is, or a fresh ``default_rng(seed)`` for an int seed."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, int | np.integer) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy Generator or an int seed, got {type(rng).__name__}")


def _int_vector(values: ArrayLike, what: str) -> np.ndarray:
    arr = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_clients(num_clients: object, num_samples: int) -> int:
    n = _check_count("num_clients", num_clients)
    if num_samples < n:
        raise ValueError(f"num_clients={n} exceeds the {num_samples} samples; every client needs a sample")
    return n


def iid(num_samples: int, num_clients: int, rng: RngLike) -> list[np.ndarray]:
    """A random permutation cut into ``num_clients`` near-equal parts."""
    num_samples = _check_count("num_samples", num_samples)
    num_clients = _check_clients(num_clients, num_samples)
    perm = as_rng(rng).permutation(num_samples)
    return [np.sort(part) for part in np.array_split(perm, num_clients)]


def _assign_classes(
    classes: np.ndarray, num_clients: int, k: int, gen: np.random.Generator
) -> list[list[int]]:
    """``k`` distinct classes per client, every class used floor/ceil(num_clients*k/C) times."""
    num_classes = len(classes)
    base, extra = divmod(num_clients * k, num_classes)
    remaining = np.full(num_classes, base, dtype=np.int64)
    remaining[gen.permutation(num_classes)[:extra]] += 1
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for client in range(num_clients):
        # The k classes with the most uses left (random tie-break) keep the rest of the plan feasible.
        order = np.lexsort((gen.random(num_classes), -remaining))[:k]
        remaining[order] -= 1
        for c in order:
            holders[int(c)].append(client)
    return holders


def label_skew(
    labels: ArrayLike, num_clients: int, max_classes_per_client: int, rng: RngLike, max_attempts: int = 100
) -> list[np.ndarray]:
    """Label-skew non-IID split: each client holds at most ``max_classes_per_client`` classes.

    Algorithm (every sample goes to exactly one client): with ``C`` classes present and
    ``k = min(max_classes_per_client, C)``, plan ``num_clients * k`` (client, class) slots in which every
    class appears floor or ceil of ``num_clients * k / C`` times (so at least once); fill clients one at
    a time with the ``k`` classes that have the most slots left, ties broken at random, which always
    yields ``k`` distinct classes per client. Then each class's samples are shuffled and split into
    near-equal parts among the clients holding it. If a class has fewer samples than holders some client
    may end up empty; the plan is redrawn (up to ``max_attempts``) before a ValueError.
    """
    y = _int_vector(labels, "labels")
    num_clients = _check_clients(num_clients, len(y))
    k_max = _check_count("max_classes_per_client", max_classes_per_client)
    classes = np.unique(y)
    k = min(k_max, len(classes))
    if num_clients * k < len(classes):
        raise ValueError(
            f"{num_clients} clients x {k_max} classes each cannot cover the {len(classes)} classes present; "
            f"need num_clients * max_classes_per_client >= {len(classes)}"
        )
    gen = as_rng(rng)
    by_class = [np.flatnonzero(y == c) for c in classes]
    for _ in range(_check_count("max_attempts", max_attempts)):
        holders = _assign_classes(classes, num_clients, k, gen)
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx, owners in zip(by_class, holders, strict=True):
            for client, chunk in zip(owners, np.array_split(gen.permutation(idx), len(owners)), strict=True):
                parts[client].append(chunk)
        clients = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(c) for c in clients) > 0:
            return clients
    raise ValueError(
        f"label_skew: some client stayed empty after {max_attempts} attempts; classes have too few samples "
        f"(smallest class: {min(len(i) for i in by_class)}) for {num_clients} clients x {k} classes"
    )


def dirichlet(
    labels: ArrayLike,
    num_clients: int,
    alpha: float,
    rng: RngLike,
    min_size: int = 1,
    *,
    balance: bool = True,
    max_attempts: int = 1000,
) -> list[np.ndarray]:
    """Per-class Dirichlet(``alpha``) proportions (Hsu et al. 2019); smaller alpha = more skew.

    For each class, proportions ``p ~ Dir(alpha * 1)`` over the clients cut the shuffled class samples.
    With ``balance`` (the NIID-Bench / FedMA convention) clients that already hold ``N / num_clients``
    samples get no more. The whole draw is repeated until every client has ``>= min_size`` samples, at
    most ``max_attempts`` times, then a ValueError.
    """
    y = _int_vector(labels, "labels")
    num_clients = _check_clients(num_clients, len(y))
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.number) or not 0 < alpha < np.inf:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    min_size = _check_count("min_size", min_size, minimum=0)
    if num_clients * min_size > len(y):
        raise ValueError(f"{num_clients} clients x min_size {min_size} exceeds the {len(y)} samples")
    gen = as_rng(rng)
    by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
    cap = len(y) / num_clients
    for _ in range(_check_count("max_attempts", max_attempts)):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            p = gen.dirichlet(np.full(num_clients, float(alpha)))
            if balance:
                p = p * (sizes < cap)
            if not np.isfinite(p.sum()) or p.sum() <= 0:  # underflow at tiny alpha: spread evenly
                p = (sizes < cap).astype(np.float64) if balance else np.ones(num_clients)
            cuts = (np.cumsum(p / p.sum()) * len(idx)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(gen.permutation(idx), cuts)):
                parts[client].append(chunk)
                sizes[client] += len(chunk)
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(p)) for p in parts]
    raise ValueError(
        f"dirichlet: could not give all {num_clients} clients >= {min_size} samples in {max_attempts} "
        f"draws with alpha={alpha}; use a larger alpha, fewer clients or a smaller min_size"
    )


def natural(
    groups: ArrayLike,
    num_clients: int | None = None,
    rng: RngLike | None = None,
    *,
    pick: str = "first",
    min_size: int = 1,
) -> list[np.ndarray]:
    """One client per natural owner (e.g. FEMNIST writer), clients in increasing group id order.

    Only groups with at least ``min_size`` samples become clients (e.g. paper 001's writers with >= k
    images). ``num_clients=None`` keeps every such group; otherwise ``pick="first"`` keeps the
    ``num_clients`` smallest group ids and ``pick="random"`` a random subset (needs ``rng``). Samples of
    groups that are not kept belong to no client.
    """
    g = _int_vector(groups, "groups")
    min_size = _check_count("min_size", min_size)
    order = np.argsort(g, kind="stable")
    ids, starts = np.unique(g[order], return_index=True)
    members = np.split(order, starts[1:]) if len(g) else []
    big = [i for i, m in enumerate(members) if len(m) >= min_size]
    ids, members = ids[big], [members[i] for i in big]
    chosen = np.arange(len(ids))
    if num_clients is not None:
        n = _check_count("num_clients", num_clients)
        if n > len(ids):
            raise ValueError(
                f"natural: asked for {n} clients but there are only {len(ids)} groups"
                + (f" with >= {min_size} samples" if min_size > 1 else "")
            )
        if pick == "first":
            chosen = chosen[:n]
        elif pick == "random":
            if rng is None:
                raise ValueError("natural: pick='random' needs an rng (Generator or int seed)")
            chosen = np.sort(as_rng(rng).choice(len(ids), size=n, replace=False))
        else:
            raise ValueError(f"natural: pick must be 'first' or 'random', got {pick!r}")
    return [np.sort(members[i]) for i in chosen]


# --- by name, on an ImageDataset --------------------------------------------------------------------


def _labels(dataset: ImageDataset, partitioner: str) -> ArrayLike:
    if dataset.labels is None:  # a language-modelling text data set
        raise ValueError(f"the {partitioner} partition splits by label, and {dataset.name!r} has no labels; "
                         "use 'iid'")  # fmt: skip
    return dataset.labels


def _run_iid(dataset: ImageDataset, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return iid(len(dataset), num_clients, rng)


def _run_label_skew(
    dataset: ImageDataset, num_clients: int, rng: np.random.Generator, *, max_classes_per_client: int = 5
) -> list[np.ndarray]:
    return label_skew(_labels(dataset, "label_skew"), num_clients, max_classes_per_client, rng)


def _run_dirichlet(
    dataset: ImageDataset,
    num_clients: int,
    rng: np.random.Generator,
    *,
    alpha: float = 0.5,
    min_size: int = 1,
    balance: bool = True,
) -> list[np.ndarray]:
    return dirichlet(_labels(dataset, "dirichlet"), num_clients, alpha, rng, min_size, balance=balance)


def _run_natural(
    dataset: ImageDataset,
    num_clients: int | None,
    rng: np.random.Generator,
    *,
    pick: str = "first",
    min_size: int = 1,
) -> list[np.ndarray]:
    if dataset.groups is None:
        raise ValueError(f"natural partition needs per-sample groups; dataset {dataset.name!r} has none")
    return natural(dataset.groups, num_clients, rng, pick=pick, min_size=min_size)


for _name, _run, _summary in (
    ("iid", _run_iid, "uniform random shares"),
    ("label_skew", _run_label_skew, "each client holds a few classes (paper 000's non-IID split)"),
    ("dirichlet", _run_dirichlet, "class shares drawn from Dirichlet(alpha)"),
    ("natural", _run_natural, "the data set's own groups (FEMNIST's writers)"),
):
    PARTITIONERS.register(_name, _run, summary=_summary)


def partition_options(name: str) -> dict[str, Any]:
    """The options partitioner ``name`` takes, with their defaults."""
    fn = _lookup(name)
    params = inspect.signature(fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _lookup(name: str) -> Callable[..., list[np.ndarray]]:
    try:
        return PARTITIONERS.get(name)
    except UnknownNameError as exc:
        raise ValueError(str(exc)) from None


def partition(
    name: str, dataset: ImageDataset, num_clients: int | None, seed: RngLike, **options: Any
) -> list[np.ndarray]:
    """Run partitioner ``name`` on ``dataset``; ``num_clients=None`` is only valid for ``"natural"``."""
    fn = _lookup(name)
    valid = partition_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for partitioner {name!r}; valid options: {sorted(valid)}"
        )
    if num_clients is None and name.lower() != "natural":
        raise ValueError(f"partitioner {name!r} needs num_clients")
    clients = fn(dataset, num_clients, as_rng(seed), **options)
    logger.debug("%s partition of %s: %d clients", name, dataset.name, len(clients))
    return clients

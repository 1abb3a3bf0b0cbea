"""The transformer models of paper 002 in :data:`gradleak.registry.MODELS` (modality ``text``).

A text model's factory takes the :class:`~gradleak.registry.ModelFactory` call (``input_shape`` ``(T,)``,
``num_classes`` = the classifier's labels) and ``task`` (``"causal_lm"`` or ``"classification"``; None:
the model's own default) and returns a :class:`~gradleak.text.models.TextModel` (the module and its
tokenizer). ``transformers`` is imported only when a model is built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from gradleak.registry import MODELS
from gradleak.text.models import BUILDERS, TextModel


def default_task(build: Callable[..., TextModel]) -> str:
    """The task a builder trains when none is named (its ``task`` parameter's default)."""
    return str(inspect.signature(build).parameters["task"].default)


def _factory(build: Callable[..., TextModel]) -> Callable[..., TextModel]:
    def factory(
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        task: str | None = None,
        seed: int = 0,
        **options: Any,
    ) -> TextModel:
        task = task or default_task(build)
        kwargs = dict(options) if task == "causal_lm" else {"num_labels": num_classes, **options}
        return build(task, seed=seed, **kwargs)

    factory.default_task = default_task(build)  # type: ignore[attr-defined]
    return factory


for name, (build, summary) in BUILDERS.items():
    MODELS.register(name, _factory(build), summary=f"{summary}; task {default_task(build)}", modality="text")

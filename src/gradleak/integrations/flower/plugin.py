"""The ``flower`` engine, registered in :data:`gradleak.registry.ENGINES` through gradleak's own plugin entry
point (``gradleak.plugins``: ``flower = "gradleak.integrations.flower.plugin"`` in pyproject.toml), the way
a user's engine would be: the federation package does not name its integrations.

Loading this module is cheap: Flower and Ray are imported only when the engine is built
(:class:`~gradleak.integrations.flower.engine.FlowerRunner`), so a config names ``engine.name = "flower"``
and has it checked without the ``flower`` extra installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradleak.integrations.flower.config import FlowerEngineConfig
from gradleak.registry import ENGINES

if TYPE_CHECKING:
    from gradleak.federation.engines import EngineRunner


def flower_runner(config: FlowerEngineConfig) -> EngineRunner:
    """The Flower engine (needs the ``flower`` extra: ``pip install 'gradleak[flower]'``)."""
    try:
        from gradleak.integrations.flower.engine import FlowerRunner
    except ImportError as exc:
        raise RuntimeError(
            f"engine 'flower' needs Flower and Ray ({exc}); install the flower extra: "
            "pip install 'gradleak[flower]' (the project's `make` bootstrap includes it)"
        ) from None
    return FlowerRunner(config)


ENGINES.register(
    "flower", flower_runner, config_cls=FlowerEngineConfig,
    summary="Flower's simulation engine on Ray: one virtual SuperNode per client",
)  # fmt: skip

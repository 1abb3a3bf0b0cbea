"""Client-side defenses (hooks into local training); see :mod:`gradleak.defenses.base`."""

from gradleak.defenses import aegis_llm as _aegis_llm  # noqa: F401  (registers)
from gradleak.defenses import baselines as _baselines  # noqa: F401  (registers)
from gradleak.defenses import dp_sgd as _dp_sgd  # noqa: F401  (registers)
from gradleak.defenses import outpost as _outpost  # noqa: F401  (registers)
from gradleak.defenses import pruning as _pruning  # noqa: F401  (registers)
from gradleak.defenses import update_dp as _update_dp  # noqa: F401  (registers)
from gradleak.defenses.aegis import defense as _aegis  # noqa: F401  (registers)
from gradleak.defenses.base import Defense, DefenseChain, DefenseFailure

__all__ = ["Defense", "DefenseChain", "DefenseFailure"]

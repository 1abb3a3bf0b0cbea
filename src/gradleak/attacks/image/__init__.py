"""Optimisation-based image attacks (gradient inversion)."""

from gradleak.attacks.image import bn_prior as _bn_prior  # noqa: F401  (registers)
from gradleak.attacks.image import dlg as _dlg  # noqa: F401  (registers)
from gradleak.attacks.image import gi_nas as _gi_nas  # noqa: F401  (registers)
from gradleak.attacks.image import ig as _ig  # noqa: F401  (registers)
from gradleak.attacks.image import ig_noise as _ig_noise  # noqa: F401  (registers)
from gradleak.attacks.image import label_counts as _label_counts  # noqa: F401  (registers)
from gradleak.attacks.image import nlsme as _nlsme  # noqa: F401  (registers)
from gradleak.attacks.image import pisme as _pisme  # noqa: F401  (registers)
from gradleak.attacks.image import sme as _sme  # noqa: F401  (registers)

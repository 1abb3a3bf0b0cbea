"""DAGER (Petrov et al., NeurIPS 2024) and the variants built on it: ``dager`` / ``dager_fedavg``
(:mod:`.core`: span estimation and the token and sequence search of :mod:`.search`), ``dager_spectral``
(adaptive to DP noise), ``dager_masked`` (adaptive to sparsification) and ``dager_lora`` (LoRA adapter
updates)."""

from gradleak.attacks.text.dager import core as _core  # noqa: F401  (registers)
from gradleak.attacks.text.dager import lora as _lora  # noqa: F401
from gradleak.attacks.text.dager import masked as _masked  # noqa: F401
from gradleak.attacks.text.dager import spectral as _spectral  # noqa: F401

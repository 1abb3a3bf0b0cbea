"""Malicious-server linear-leakage attacks: Robbing the Fed, LOKI, Scale-MIA (docs/attacks-linear.md)."""

from gradleak.attacks.linear import loki as _loki  # noqa: F401  (registers)
from gradleak.attacks.linear import robbing_the_fed as _robbing_the_fed  # noqa: F401  (registers)
from gradleak.attacks.linear import rtf_aegis as _rtf_aegis  # noqa: F401  (registers)
from gradleak.attacks.linear import scale_mia as _scale_mia  # noqa: F401  (registers)

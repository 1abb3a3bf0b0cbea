"""Malicious-server attacks: Robbing the Fed, LOKI, Scale-MIA, and those written into the model's own layers
(in_place: RtF/LOKI bins, trap weights, class fishing) (docs/attacks-linear.md)."""

from gradleak.attacks.linear import in_place as _in_place  # noqa: F401  (registers)
from gradleak.attacks.linear import loki as _loki  # noqa: F401  (registers)
from gradleak.attacks.linear import robbing_the_fed as _robbing_the_fed  # noqa: F401  (registers)
from gradleak.attacks.linear import rtf_aegis as _rtf_aegis  # noqa: F401  (registers)
from gradleak.attacks.linear import scale_mia as _scale_mia  # noqa: F401  (registers)

"""Analytical text attacks of paper 002: DAGER and its side channels (registered in ATTACKS).

``dager`` / ``dager_fedavg`` (attention-gradient spans), ``dager_spectral`` (the spans above a known
noise scale's bulk edge: adaptive, against DP noise), ``dager_masked`` (a low-rank completion of a
sparsified gradient's kept entries: adaptive, against pruning), ``embedding_norm`` (Channel 2), ``mlp_svd``
(Channel 3, adaptive), ``mlp_spectral`` (Channel 3 above a noise or flood's bulk edge: adaptive, against
AEGIS's MLP flood and DP noise), ``lm_head_probe`` (untied heads); ``tag`` and ``lamp`` (embedding matching
on a classifier's gradient, issue 53), ``fedspy`` (FedSpy-LLM as read here: gradient tokens, ordered by
partial-gradient alignment, issue 53), ``grab`` (GRAB as read here: LAMP's matching with learned dropout
masks), ``somp`` (SOMP as read here: DAGER's token test, then OMP over block 2's head blocks);
``peftleak_lora`` (a malicious server's pass-through backbone and MLP bins read off LoRA adapters, issue
52); ``utr`` (UTR: DAGER's span test on bottleneck adapters' down projections, issue 52). For text,
``Observation.input_shape`` is ``(seq_len,)`` (the padded length) and ``num_classes`` the label count
(classification) or the vocabulary size (causal LM); the attacks read neither.
"""

from gradleak.attacks.text import dager as _dager  # noqa: F401  (registers DAGER and its adaptive variants)
from gradleak.attacks.text import embedding_match as _embedding_match  # noqa: F401
from gradleak.attacks.text import embedding_norm as _embedding_norm  # noqa: F401
from gradleak.attacks.text import fedspy as _fedspy  # noqa: F401
from gradleak.attacks.text import grab as _grab  # noqa: F401
from gradleak.attacks.text import lm_head as _lm_head  # noqa: F401
from gradleak.attacks.text import mlp_spectral as _mlp_spectral  # noqa: F401
from gradleak.attacks.text import mlp_svd as _mlp_svd  # noqa: F401
from gradleak.attacks.text import peftleak as _peftleak  # noqa: F401
from gradleak.attacks.text import somp as _somp  # noqa: F401
from gradleak.attacks.text import utr as _utr  # noqa: F401

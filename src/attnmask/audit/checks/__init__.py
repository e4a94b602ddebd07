"""The leak audit's checks, one module each, and :func:`audit`, which runs them in this order:

- :mod:`.causality`: no output moves when a token the intended mask blocks is replaced;
- :mod:`.gradient`: no output has a gradient w.r.t. a blocked token's embedding (however weak);
- :mod:`.padding`: ``padding`` and ``source padding``: real outputs ignore the amount of padding
  and the ids written in the pads;
- :mod:`.cache_parity`: cached token-by-token logits equal the full forward;
- :mod:`.fully_padded`: ``fully padded rows``: an all-pad row gives finite logits, disturbs nothing;
- :mod:`.cross_request`: ``cross-request``: requests packed into one step of the serving engine never
  see each other, bit for bit;
- :mod:`.layer_reach`: ``layer reach``: each decoder layer alone, at the last position, reaches no
  further back than its own window (Gemma 3's sliding layers), and as far as it declares.

:mod:`.probe` is what they share (the random inputs, the forward calls, the perturbation
measurement); :mod:`.runner` runs them and assembles the :class:`~attnmask.audit.report.AuditReport`.
Tolerances come from :mod:`attnmask.audit.tolerance`.
"""

from attnmask.audit.checks.gradient import GRADIENT_EPS_FACTOR  # noqa: F401
from attnmask.audit.checks.runner import CHECKS, audit  # noqa: F401
from attnmask.audit.tolerance import CACHE_TOLERANCE_FACTOR, Tolerance  # noqa: F401

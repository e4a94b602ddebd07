"""Audits that prove no token peeks: causality, padding invariance, cache parity, no NaN.

- :mod:`.checks`: the checks and :func:`audit`;
- :mod:`.subjects`: anything that maps ids to logits (attnmask models, runs, Hugging Face models);
- :mod:`.faults`: deliberately broken masks that the audit must catch;
- :mod:`.report`: the report, its table, JSON and pictures;
- :mod:`.conform`: every mask scenario under every attention implementation of a Hugging Face
  model (:mod:`.conform_scenarios` runs them, :mod:`.conform_models` loads models and finds
  implementations, :mod:`.conform_report` renders the verdict).
"""

from attnmask.audit.checks import (  # noqa: F401
    CACHE_TOLERANCE_FACTOR,
    CHECKS,
    GRADIENT_EPS_FACTOR,
    Tolerance,
    audit,
)
from attnmask.audit.conform import AGREEMENT_TOLERANCE, SCENARIOS, conform  # noqa: F401
from attnmask.audit.conform_report import ConformReport, ConformResult  # noqa: F401
from attnmask.audit.faults import (  # noqa: F401
    ENCODER_DECODER_ONLY,
    FAULTS,
    BidirectionalDecoder,
    OffByOneDecoder,
    PaddingLeakDecoder,
    ReversedCumsumDecoder,
    SourcePaddingLeak,
    inject,
    tiny_model,
)
from attnmask.audit.report import (  # noqa: F401
    AuditReport,
    CheckResult,
    Leak,
)
from attnmask.audit.subjects import (  # noqa: F401
    SIDES,
    Subject,
    as_subject,
    from_callable,
    from_hf,
    from_run,
    from_transformer,
    positions_from_mask,
)

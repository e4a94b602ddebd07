"""Audits that prove no token peeks: causality, padding invariance, cache parity, no NaN.

- :mod:`.checks`: :func:`audit` and its checks, one module each;
- :mod:`.subjects`: anything that maps ids to logits (attnmask models, runs, Hugging Face models);
- :mod:`.faults`: deliberately broken masks that the audit must catch;
- :mod:`.tolerance`: how far logits may differ and still count as equal, by dtype and purpose;
- :mod:`.findings`: what every report shares (findings, verdict, JSON); :mod:`.report`: the
  audit's report, its table, JSON and pictures;
- :mod:`.conform`: every mask scenario under every attention implementation of a Hugging Face
  model (its own package: runner, scenarios, models, report).
"""

from attnmask.audit.checks import CHECKS, GRADIENT_EPS_FACTOR, audit  # noqa: F401
from attnmask.audit.conform import AGREEMENT_TOLERANCE, SCENARIOS, ConformReport, ConformResult, conform  # noqa: F401
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
from attnmask.audit.findings import Finding, Report  # noqa: F401
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
from attnmask.audit.tolerance import CACHE_TOLERANCE_FACTOR, TOLERANCES, Tolerance  # noqa: F401

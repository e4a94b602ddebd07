"""Conformance: every mask scenario under every attention implementation of a Hugging Face model.

- :mod:`.runner`: :func:`conform`, the entry point (and the list of scenarios, with what each checks);
- :mod:`.scenarios`: the scenarios themselves, run under one implementation at a time;
- :mod:`.models`: tiny and local models to check, the implementations a model accepts, and
  attnmask's float64 reference with the same weights;
- :mod:`.report`: the verdict, one result per scenario and implementation, as a table and JSON.

Tolerances come from :mod:`attnmask.audit.tolerance`; the perturbation measurements from the leak
audit (:func:`attnmask.audit.checks.audit`).
"""

from attnmask.audit.conform.models import (  # noqa: F401
    TINY_CONFIGS,
    implementations,
    load_model,
    reach,
    reference_model,
    set_implementation,
)
from attnmask.audit.conform.report import ConformReport, ConformResult  # noqa: F401
from attnmask.audit.conform.runner import AGREEMENT_TOLERANCE, SCENARIOS, conform  # noqa: F401

"""Where attnmask keeps what it derives from downloaded files: converted checkpoints, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ATTNMASK_CACHE``, else ``$XDG_CACHE_HOME/attnmask``, else ``~/.cache/attnmask``."""
    if os.environ.get("ATTNMASK_CACHE"):
        return Path(os.environ["ATTNMASK_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnmask"

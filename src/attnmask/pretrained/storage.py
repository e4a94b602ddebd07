"""Where attnmask keeps what it derives from downloaded files: converted checkpoints, compiled kernels."""

from __future__ import annotations

from attnmask.native import cache_dir

__all__ = ["cache_dir"]

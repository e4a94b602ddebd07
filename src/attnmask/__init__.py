"""attnmask: masked attention done right and fast."""

__version__ = "0.1.0"

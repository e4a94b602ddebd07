"""attnmask: masked attention done right and fast."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy re-export: `import attnmask` stays light (no torch) until load_run is used.
    if name == "load_run":
        from attnmask.train.rundir import load_run

        return load_run
    raise AttributeError(f"module 'attnmask' has no attribute {name!r}")

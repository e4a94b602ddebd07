"""Everything a training run reports, in one place: log lines, the progress bar, ``metrics.jsonl``
and TensorBoard scalars. Only rank 0 writes; on other ranks every call is a no-op."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from attnmask.train.rundir import METRICS, TENSORBOARD

# How a metric is shown in a log line; metrics not listed are recorded but not printed.
FORMATS = {"loss": "{:.3f}", "ppl": "{:.2f}", "bleu": "{:.2f}", "chrf": "{:.2f}", "exact_match": "{:.2%}"}


def default_log(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg)  # keeps an active progress bar intact


def bar_wanted(bar_class: type) -> bool:
    """Whether a progress bar belongs where it would be drawn: on a terminal, or as a notebook's
    widget. Redirected to a file, a text bar would write thousands of ``\\r`` updates into it; the
    log lines (:func:`default_log`) print there all the same."""
    if sys.stderr is not None and sys.stderr.isatty():
        return True
    from tqdm.notebook import tqdm_notebook

    return issubclass(bar_class, tqdm_notebook)


def fmt(metrics: dict) -> str:
    """``loss 1.234, bleu 30.12, exact_match 97.10%`` for a log line."""
    return ", ".join(f"{key} {form.format(metrics[key])}" for key, form in FORMATS.items() if key in metrics)


class TrainLogger:
    """Log lines (``log``), a tqdm bar (on a terminal or in a notebook only), ``metrics.jsonl`` and
    TensorBoard for one invocation.

    Lines can be logged at once; :meth:`open` starts the bar and the files (at ``step``, purging
    TensorBoard records after it on a resume), :meth:`close` ends them and is safe to repeat.
    """

    def __init__(self, out: Path, *, is_main: bool, log: Callable[[str], None] | None = None):
        self.out, self.is_main = Path(out), is_main
        self._log = log or default_log
        self._bar = self._writer = self._metrics = None

    def line(self, msg: str) -> None:
        if self.is_main:
            self._log(msg)

    def open(self, *, step: int, total: int | None, resume: bool, progress: bool) -> None:
        if not self.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm.auto import tqdm

        self._writer = SummaryWriter(str(self.out / TENSORBOARD), purge_step=step if resume else None)
        self._metrics = open(self.out / METRICS, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        show = progress and bar_wanted(tqdm)
        self._bar = tqdm(total=total, initial=step, unit="step", dynamic_ncols=True, disable=not show, desc="train")

    def record(self, rec: dict) -> None:
        """One metrics.jsonl line and its TensorBoard scalars: ``{"step", "split", ...}``."""
        if self._metrics is None:
            return
        self._metrics.write(json.dumps(rec) + "\n")
        self._metrics.flush()
        for key, val in rec.items():
            if key not in ("step", "split") and isinstance(val, (int, float)):
                self._writer.add_scalar(f"{rec['split']}/{key}", val, rec["step"])

    def evaluation(self, step: int, metrics: dict, elapsed_s: float | None = None) -> None:
        """A validation record (with the training loop's clock, for curves against wall time)."""
        clock = {} if elapsed_s is None else {"elapsed_s": elapsed_s}
        self.record({"step": step, "split": "valid", **metrics, **clock})
        self.line(f"step {step}: {fmt(metrics)}")

    def advance(self, postfix: dict | None = None) -> None:
        """One optimizer step done; ``postfix`` (loss, tokens/s) refreshes the bar's figures."""
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix(**postfix, refresh=False)
        self._bar.update(1)

    def end_progress(self) -> None:
        """Close the bar (the last evaluation's lines print below it); the files stay open."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        for thing in (self._bar, self._writer, self._metrics):
            if thing is not None:
                thing.close()
        self._bar = self._writer = self._metrics = None

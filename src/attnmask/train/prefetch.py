"""The next batch is built while the current step runs.

:class:`Prefetcher` wraps a :class:`~attnmask.train.tasks.TrainingTask`: a background thread calls
``task.next_batch()`` (tokens to padded or packed tensors, the move to the device) one batch ahead
of the training loop, so the loop never waits for its data. PyTorch's kernels release the GIL, so the
Python work of building a batch overlaps the step.

Resuming stays exact: with every prefetched batch the thread records the task's data position
*after* drawing it, and :meth:`Prefetcher.state_dict` returns the position after the last batch the
loop has *consumed*, so a checkpoint never skips the batch that was waiting in the queue.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading

from attnmask.errors import UserError
from attnmask.train.tasks import Batch, TrainingTask

_DONE = object()


class Prefetcher:
    """Hands out ``task``'s batches, the next one always in the making (``depth`` batches ahead)."""

    def __init__(self, task: TrainingTask, depth: int = 1):
        if depth < 1:
            raise UserError(f"depth={depth}; expected at least one batch ahead")
        self.task = task
        self.depth = depth
        self._state = copy.deepcopy(task.state_dict())  # the data position after the last consumed batch
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.task.next_batch()
                item = (batch, copy.deepcopy(self.task.state_dict()))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the loop, which raises it where it asked for a batch
            self._queue.put((_DONE, e))

    def next_batch(self) -> Batch:
        if self._thread is None:
            self._queue = queue.Queue(maxsize=self.depth)
            self._stop.clear()
            self._thread = threading.Thread(target=self._work, name="attnmask-prefetch", daemon=True)
            self._thread.start()
        batch, state = self._queue.get()
        if batch is _DONE:
            self._thread = None
            raise state
        self._state = state
        return batch

    def state_dict(self) -> dict:
        """The task's data position after the last batch handed out (not after the prefetched ones)."""
        return self._state

    def close(self) -> None:
        """Stop the thread and rewind the task to the last consumed batch, so that drawing from the
        task directly (or a new Prefetcher) continues exactly where the loop stopped."""
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):  # unblock a thread waiting to put
                self._queue.get(timeout=0.05)
        self._thread = None
        self.task.load_state_dict(copy.deepcopy(self._state))

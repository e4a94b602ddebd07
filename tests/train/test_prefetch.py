"""The prefetching thread: same batches in the same order, exact data positions, errors surface."""

from __future__ import annotations

import threading

import pytest

from attnmask.train.prefetch import Prefetcher


class CountingTask:
    """A task whose batches are 0, 1, 2, ... and whose data position is the next number."""

    def __init__(self, fail_at: int | None = None):
        self.position = 0
        self.fail_at = fail_at
        self.threads: set[str] = set()

    def next_batch(self):
        self.threads.add(threading.current_thread().name)
        if self.position == self.fail_at:
            raise ValueError(f"bad line in batch {self.position}")
        self.position += 1
        return self.position - 1

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


@pytest.mark.parametrize("depth", [1, 3])
def test_batches_come_in_order_and_the_state_is_the_consumed_position(depth):
    task = CountingTask()
    batches = Prefetcher(task, depth=depth)
    assert batches.state_dict() == {"position": 0}
    assert [batches.next_batch() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert batches.state_dict() == {"position": 5}  # not the prefetched position
    assert "attnmask-prefetch" in task.threads  # built on the background thread
    batches.close()
    assert task.position == 5  # rewound to what the loop consumed
    assert Prefetcher(task).next_batch() == 5  # a resumed loop continues with the next batch


def test_an_error_while_building_a_batch_is_raised_in_the_loop():
    batches = Prefetcher(CountingTask(fail_at=2))
    assert [batches.next_batch(), batches.next_batch()] == [0, 1]
    with pytest.raises(ValueError, match="bad line in batch 2"):
        batches.next_batch()
    assert batches.state_dict() == {"position": 2}


def test_close_without_a_batch_drawn_is_harmless():
    task = CountingTask()
    Prefetcher(task).close()
    assert task.position == 0

"""The cross-request check: requests packed into one step of the serving engine never see each other,
and each gets the logits it gets alone, bit for bit, and requests that start from another's kept cache
blocks (prefix caching) answer as alone. Watched catching a kernel that lets rows read another
sequence's keys, one whose result depends on how many rows it is given, and a prefix cache that hands
a request the right blocks in the wrong order."""

import pytest
import torch

from attnmask import ops
from attnmask.audit import audit
from attnmask.model import fuse_projections_
from attnmask.ops import decoding
from tests.audit.helpers import statuses
from tests.conftest import tiny_model
from tests.engine.test_step import model_of

pytestmark = pytest.mark.usefixtures("one_thread")


def decoder():
    return fuse_projections_(
        tiny_model("decoder", vocab=24, std=0.5, positions="rotary", n_heads=4, n_kv_heads=2, norm="rmsnorm",
                   activation="swiglu", tie_embeddings=False)
    ).eval()  # fmt: skip


def assert_caught(problem: str) -> None:
    """The check on :func:`decoder` fails, with a problem that says ``problem``."""
    report = audit(decoder(), length=10, checks=["cross-request"])
    assert not report.passed
    assert any(problem in p for p in report.check("cross-request").problems), report.check("cross-request").problems


def test_an_attnmask_decoder_keeps_requests_apart():
    report = audit(decoder(), length=10, checks=["cross-request", "cache parity"])
    assert statuses(report) == {"cross-request": "PASS", "cache parity": "PASS"}
    check = report.check("cross-request")
    assert check.max_deviation == 0.0 and check.tolerance == "bitwise"
    assert check.details[-2] == "each request alone = packed, bit for bit (3 requests, lengths [10, 7, 5])"
    assert check.details[-1] == (
        "requests starting from another's kept blocks answer as alone, bit for bit (20 prompt positions reused)"
    )
    assert "packed step (paged cache, chunks of 3)" in report.check("cache parity").details


def test_a_kernel_that_reads_another_sequences_keys_is_caught(monkeypatch):
    real = decoding.paged_attend

    def leaky(q, k_pool, v_pool, tables, row_seq, row_pos, window, heads, scale):
        # every row reads the first sequence's blocks: request 0 leaks into the others
        return real(q, k_pool, v_pool, tables, torch.zeros_like(row_seq), row_pos, window, heads, scale)

    monkeypatch.setattr(decoding, "paged_attend", leaky)
    report = audit(decoder(), length=10, checks=["cross-request"])
    check = report.check("cross-request")
    assert not report.passed and check.max_deviation > 0
    assert check.problems[0].startswith("replacing request 0's tokens moved request 1's logits (first at position 0")


def test_a_kernel_that_depends_on_the_batch_is_caught(monkeypatch):
    real = decoding.paged_attend

    def batch_dependent(q, *args):
        out = real(q, *args)
        return out * (1 + 1e-7 * q.shape[0])  # a result that depends on the number of rows packed

    monkeypatch.setattr(decoding, "paged_attend", batch_dependent)
    assert_caught("alone (chunks of 1) differs from request")


def test_encoder_decoders_are_not_served_so_skipped():
    model = tiny_model("encoder_decoder", positions="rotary", norm="rmsnorm", activation="swiglu")
    report = audit(model, length=6, src_length=5, checks=["cross-request"])
    assert report.check("cross-request").skipped == "the model is not served by the packed step"


def test_without_native_kernels_the_step_stays_invariant(monkeypatch):
    """Products one row at a time (what runs where the native kernels are not built): still bit for bit."""
    from attnmask.ops import native

    monkeypatch.setattr(native, "_status", native.Status("disabled", "test"))
    assert not ops.available()
    report = audit(decoder(), length=8, checks=["cross-request"])
    assert report.passed, report.check("cross-request").problems


def test_a_prefix_cache_that_hands_out_the_wrong_blocks_is_caught(monkeypatch):
    from attnmask.engine import PrefixCache

    real = PrefixCache.match

    def swapped(self, tokens, most):
        k, tables = real(self, tokens, most)
        if k >= 2:  # the first two kept blocks in each other's place
            tables[0][0], tables[0][1] = tables[0][1], tables[0][0]
        return k, tables

    monkeypatch.setattr(PrefixCache, "match", swapped)
    assert_caught("started from another request's kept cache blocks")


def test_a_model_with_windows_reuses_every_layer_groups_blocks():
    """Two layers of three see their last 3 positions: the reused start (10 positions) is longer."""
    report = audit(model_of("rotary-windows").eval(), length=10, checks=["cross-request"])
    assert report.passed, report.check("cross-request").problems
    assert "(20 prompt positions reused)" in report.check("cross-request").details[-1]

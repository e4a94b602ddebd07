"""The deliberately broken models: each fault exists, and one that needs an encoder says so."""

import pytest

from attnmask.audit.faults import FAULTS, inject, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_source_fault_needs_an_encoder():
    with pytest.raises(ValueError, match="encoder-decoder"):
        inject(tiny_model("decoder"), "source_padding")
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        inject(tiny_model("decoder"), "nope")
    assert set(FAULTS) == {"bidirectional", "off_by_one", "padding", "cumsum", "source_padding"}

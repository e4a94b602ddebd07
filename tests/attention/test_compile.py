"""``torch.compile(fullgraph=True)`` through attnmask: no graph break, forward and backward.

A tiny encoder-decoder with padding on both sides (key padding over the source, look-ahead & key
padding over the target, cross-attention over the padded memory) is compiled whole with
``fullgraph=True``: any graph break -- a host read such as ``.tolist()``, ``.item()``,
``torch.equal`` or ``bool(tensor)`` in the masks, the prepared mask or a kernel choice -- is an error.
The ``aot_eager`` backend traces forward and backward through Dynamo and AOTAutograd exactly as
inductor would, without spending a minute generating C++.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = torch.tensor([[5, 6, 7, 8, 0, 0], [5, 6, 7, 8, 9, 10], [5, 0, 0, 0, 0, 0]])  # 0 = <pad>
TGT = torch.tensor([[1, 5, 6, 0, 0], [1, 5, 6, 7, 8], [1, 9, 0, 0, 0]])
LABELS = torch.tensor([[5, 6, 2, -100, -100], [5, 6, 7, 8, 2], [9, 2, -100, -100, -100]])


def test_encoder_decoder_with_padding_compiles_whole_forward_and_backward():
    torch._dynamo.reset()
    eager, compiled = (tiny_model("encoder_decoder", pad_id=0, seed=1).train() for _ in range(2))

    def step(model, src, tgt, labels):
        return model(tgt, src, labels=labels).loss

    loss = step(eager, SRC, TGT, LABELS)
    loss.backward()
    fn = torch.compile(step, fullgraph=True, backend="aot_eager")  # a graph break raises here
    compiled_loss = fn(compiled, SRC, TGT, LABELS)
    compiled_loss.backward()
    assert_close(compiled_loss, loss)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # new padding (same shapes) reuses the graph: the mask's values are data, not guards
    src2 = SRC.clone()
    src2[0, 3:] = 0
    assert_close(fn(compiled, src2, TGT, LABELS), step(eager, src2, TGT, LABELS))


def test_flex_backend_compiles_whole_for_inference():
    """The flex backend builds its BlockMask inside the compiled graph (no graph break)."""
    torch._dynamo.reset()
    model = tiny_model("encoder_decoder", pad_id=0, seed=2, attn_backend="flex")
    reference = tiny_model("encoder_decoder", pad_id=0, seed=2)

    def forward(m, src, tgt):
        return m(tgt, src).logits

    with torch.no_grad():
        out = torch.compile(forward, fullgraph=True, backend="aot_eager")(model, SRC, TGT)
        assert_close(out, forward(reference, SRC, TGT), rtol=1e-5, atol=1e-5)

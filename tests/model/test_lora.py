"""LoRA adapters: the base model's function at zero, gradients on adapters only, save/load/merge round trip."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from attnmask.errors import UserError
from attnmask.model.lora import LoRALinear, add_lora, load_lora, lora_state_dict, merge_lora
from tests.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(3, 24, (2, 9), generator=torch.Generator().manual_seed(0))


def lora_model(seed: int = 0, targets="all", **kw):
    model = tiny_model("decoder", positions="rotary", norm="rmsnorm", activation="swiglu", std=0.3, seed=seed, **kw)
    add_lora(model, rank=4, alpha=8.0, targets=targets)
    return model


def randomise_adapters(model, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.1)


def test_zero_b_gives_the_base_models_logits_exactly():
    base = tiny_model("decoder", positions="rotary", norm="rmsnorm", activation="swiglu", std=0.3)
    model = lora_model()
    assert_close(model(IDS).logits, base(IDS).logits, rtol=0, atol=0)


def test_only_adapters_get_gradients():
    model = lora_model().train()
    model(IDS, labels=IDS).loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all(n.endswith(("lora_a", "lora_b")) for n in with_grad)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == with_grad
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 2 * 7  # two layers, seven projections each


def test_save_load_merge_round_trip_equals_the_unmerged_model():
    model = lora_model()
    randomise_adapters(model)
    want = model(IDS).logits
    assert not torch.equal(want, tiny_model("decoder", positions="rotary", norm="rmsnorm", activation="swiglu",
                                            std=0.3)(IDS).logits)  # fmt: skip
    saved = lora_state_dict(model)
    assert all(k.endswith(("lora_a", "lora_b")) for k in saved)
    again = lora_model()  # same base, fresh adapters
    load_lora(again, {k: v.clone() for k, v in saved.items()})
    assert_close(again(IDS).logits, want, rtol=0, atol=0)
    merge_lora(again)
    assert not any(isinstance(m, LoRALinear) for m in again.modules())
    assert_close(again(IDS).logits, want, rtol=1e-5, atol=1e-5)


def test_targets_are_checked():
    with pytest.raises(UserError, match="expected a comma-separated subset"):
        lora_model(targets="qkv")
    with pytest.raises(UserError, match="tied to the embedding"):
        lora_model(targets="lm_head")
    model = lora_model(targets="q_proj,v_proj")
    assert sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoRALinear)}) == [
        "q_proj",
        "v_proj",
    ]
    with pytest.raises(UserError, match="do not fit"):
        load_lora(model, {"layers.0.self_attn.k_proj.lora_a": torch.zeros(4, 4)})

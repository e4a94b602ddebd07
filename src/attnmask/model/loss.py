"""The training loss through the prediction head without the ``(N, V)`` logits: :func:`head_loss`.

Teacher forcing ends in ``W_pred`` and a cross-entropy over every target position: with a vocabulary
of 8,000 and 4,096 positions that is a 131 MB float32 logits tensor, written by the product, read
and written again by log-softmax, its backward and (under bf16 autocast) the casts -- on a CPU
about a quarter of a bf16 training step. :func:`head_loss` computes the same summed loss a chunk of
rows at a time, and the gradient of each chunk's logits (``softmax - target``) at once, so the logits
never exist whole and no chunk is read back in the backward pass: the backward only scales the
input and weight gradients the forward pass already summed.
"""

from __future__ import annotations

import torch
from torch import Tensor

import attnmask.linear as products
from attnmask.data.collate import IGNORE_INDEX
from attnmask.errors import UserError
from attnmask.linear import linear

__all__ = ["head_loss"]

CHUNK_SCORES = 1 << 22  # logits per chunk (rows x V): 16 MiB in float32, within a server CPU's L3


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, smoothing: float,
                dtype: torch.dtype, rows: int, all_real: bool) -> Tensor:  # fmt: skip
        # h (N, C), labels (N,); products in ``dtype`` (bf16 under autocast), the softmax in float32;
        # all_real: no label is IGNORE_INDEX (the caller dropped those rows)
        acc = torch.promote_types(dtype, torch.float32)
        N, C = h.shape
        V = weight.shape[0]
        # where this CPU multiplies bfloat16 slowly, bfloat16 products as attnmask.linear computes them
        # (float32 products of bfloat16-rounded operands, each result rounded to bfloat16), with the
        # operands rounded once here rather than in every product
        widen = dtype == torch.bfloat16 and h.device.type == "cpu" and not products.fast_bf16_products()
        held = torch.float32 if widen else dtype  # the dtype the rounded operands are held in

        def rounded(t: Tensor) -> Tensor:
            return t.to(dtype).to(held)

        def product(a: Tensor, m: Tensor, bias_: Tensor | None = None) -> Tensor:
            out = linear(a, m, bias_)
            return out.to(dtype) if widen else out

        w = rounded(weight)
        b = None if bias is None else rounded(bias)
        grad_h = torch.empty(N, C, dtype=h.dtype, device=h.device)
        grad_wt = torch.zeros(C, V, dtype=acc, device=h.device)  # W's gradient, transposed
        grad_b = None if bias is None else torch.zeros(V, dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        for i in range(0, N, rows):
            hc, y = rounded(h[i : i + rows]), labels[i : i + rows]  # (R, C), (R,)
            z = product(hc, w, b).to(acc)  # (R, V) logits
            z.sub_(z.amax(dim=-1, keepdim=True))  # shifted by each row's max, in place: the same softmax
            real = (y != IGNORE_INDEX).unsqueeze(1)  # (R, 1)
            target = y.clamp(min=0).unsqueeze(1)  # (R, 1): any class for ignored rows, zeroed below
            # loss = (1 - e) (lse - z_y) + e (lse - mean z), unchanged by the shift;
            # d loss / d z = softmax - (1 - e) onehot - e / V
            row_loss = -(1 - smoothing) * z.gather(1, target)
            if smoothing:
                row_loss -= smoothing * z.mean(dim=-1, keepdim=True)
            g = z.exp_()  # in z's memory
            sums = g.sum(dim=-1, keepdim=True)  # (R, 1)
            row_loss += sums.log()
            total += (row_loss if all_real else row_loss.masked_fill(~real, 0)).sum()
            g.mul_(sums.reciprocal_())  # softmax
            if smoothing:
                g.sub_(smoothing / V)
            g.scatter_add_(1, target, torch.full_like(sums, smoothing - 1))
            if not all_real:
                g.masked_fill_(~real, 0)
            gc = rounded(g)
            grad_h[i : i + rows] = product(gc, w.t())  # (R, V) x (V, C)
            grad_wt += product(hc.t().contiguous(), gc.t())  # (C, R) x (R, V)
            if grad_b is not None:
                grad_b += g.sum(0)
        ctx.save_for_backward(grad_h, grad_wt, grad_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        grad_h, grad_wt, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        grad_w = (grad_wt.t() * grad_total).to(w_dtype).contiguous()
        return (
            grad_h * grad_total.to(grad_h.dtype),
            grad_w,
            None if grad_b is None else (grad_b * grad_total).to(b_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def head_loss(hidden: Tensor, head: torch.nn.Linear, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """Summed cross-entropy of ``head(hidden)`` against ``labels`` over the real tokens (labels equal
    to ``IGNORE_INDEX`` are skipped): ``lm_loss(head(hidden), labels, reduction="sum")[0]`` with the
    same gradients, computed in chunks of rows (see the module's docstring).

    ``hidden (B, T, C)``, ``labels (B, T)``; ``head`` an ``nn.Linear`` (C -> V). Under autocast
    the products run in the autocast dtype and the softmax in float32, as ``lm_loss`` would see them.
    """
    if hidden.shape[:-1] != labels.shape:
        raise UserError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree; expected (B, T, C) and (B, T)"
        )
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    all_real = h.device.type == "cpu" and not torch.compiler.is_compiling()
    if all_real:
        keep = y != IGNORE_INDEX  # on the CPU reading which rows are real costs nothing: skip the others
        h, y = h[keep], y[keep]
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    rows = max(16, CHUNK_SCORES // max(head.weight.shape[0], 1))
    with torch.autocast(device, enabled=False):
        return _HeadLoss.apply(h, head.weight, head.bias, y, float(label_smoothing), dtype, rows, all_real)

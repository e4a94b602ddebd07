"""Pictures of masks, of attention weights and of audited dependencies: what people would rather look at.

Text grids follow the seeds' notation: rows are queries ("from"), columns are keys ("to"),
cells are ``0`` (may attend) and ``-∞`` (blocked), or ``■`` / ``·`` with ``style="symbols"``.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from attnmask.errors import UserError

CELL = {"values": ("0", "-∞"), "symbols": ("■", "·")}

# Size caps. A picture's size follows its token count only up to a point: past it, cells are
# averaged into blocks (a downsampled heatmap), labels are thinned, and panels shrink, so memory
# and pixel counts stay bounded whatever the sequence length (300 tokens once asked matplotlib for
# a 24 GiB figure).
DPI = 120
MAX_FIGURE_PX = 6000  # longest side of any picture, in pixels
MAX_CELLS = 256  # cells drawn per axis of a panel; longer axes are averaged in blocks
MAX_ANNOTATED = 24  # mask pictures write "0" / "-∞" in each cell up to this many tokens
MAX_TICK_LABELS = 64  # every token labelled up to this many; beyond, evenly spaced ones
MAX_TEXT_GRID_TOKENS = 120  # a wider text grid wraps in any terminal and cannot be read
_MIN_PANEL_IN = 1.6  # a panel smaller than this (inches) is unreadable: refuse instead
_MAX_PANEL_IN = 9.0


def display_width(text: str) -> int:
    """Terminal columns taken by ``text``: East Asian wide and full-width characters (CJK, most
    emoji) take two, combining marks and zero-width characters none."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def _center(text: str, width: int) -> str:
    gap = max(width - display_width(text), 0)
    return " " * (gap // 2) + text + " " * (gap - gap // 2)


def _rjust(text: str, width: int) -> str:
    return " " * max(width - display_width(text), 0) + text


def _check_grid(allowed: Tensor, q_labels: Sequence[str], k_labels: Sequence[str]) -> None:
    if allowed.dim() != 2:
        raise UserError(f"a mask grid needs a 2-D (Tq, Tk) mask, got shape {tuple(allowed.shape)}")
    if (len(q_labels), len(k_labels)) != tuple(allowed.shape):
        raise UserError(
            f"{len(q_labels)} query and {len(k_labels)} key labels for a mask of shape {tuple(allowed.shape)}"
        )


def mask_grid(
    allowed: Tensor,
    q_labels: Sequence[str],
    k_labels: Sequence[str] | None = None,
    *,
    style: str = "values",
    title: str | None = None,
) -> str:
    """Render a bool ``(Tq, Tk)`` mask (True = may attend) as a token-labelled text grid."""
    if style not in CELL:
        raise UserError(f"style must be one of {sorted(CELL)}, got {style!r}")
    k_labels = list(q_labels if k_labels is None else k_labels)
    q_labels = list(q_labels)
    _check_grid(allowed, q_labels, k_labels)
    if max(allowed.shape) > MAX_TEXT_GRID_TOKENS:
        raise UserError(
            f"a text grid of {tuple(allowed.shape)} tokens is too wide to read; expected at most "
            f"{MAX_TEXT_GRID_TOKENS} tokens per side (draw a picture instead)"
        )
    yes, no = CELL[style]
    # columns line up by display width, so emoji and CJK labels do not shift the grid
    row_w = max([display_width(s) for s in q_labels] + [0])
    col_w = max([display_width(s) for s in k_labels] + [display_width(yes), display_width(no)])
    lines = []
    if title:
        lines.append(title)
    lines.append(" " * row_w + " │ " + " ".join(_center(s, col_w) for s in k_labels))
    lines.append("─" * row_w + "─┼─" + "─" * ((col_w + 1) * len(k_labels) - 1))
    for label, row in zip(q_labels, allowed.tolist()):
        cells = " ".join(_center(yes if a else no, col_w) for a in row)
        lines.append(_rjust(label, row_w) + " │ " + cells)
    return "\n".join(lines)


def _pooled(matrix: Tensor) -> tuple[Tensor, int, int]:
    """``matrix (Tq, Tk)`` averaged in blocks so that neither side exceeds :data:`MAX_CELLS`.

    Returns ``(pooled (ceil(Tq/sq), ceil(Tk/sk)) float64, sq, sk)``; a block at the edge averages
    only the cells it covers. NaN cells (blank) stay out of the averages.
    """
    Tq, Tk = matrix.shape
    sq, sk = max(1, math.ceil(Tq / MAX_CELLS)), max(1, math.ceil(Tk / MAX_CELLS))
    m = matrix.detach().to(torch.float64).cpu()  # (Tq, Tk)
    if sq == sk == 1:
        return m, 1, 1
    nq, nk = math.ceil(Tq / sq), math.ceil(Tk / sk)
    padded = torch.full((nq * sq, nk * sk), float("nan"), dtype=torch.float64)
    padded[:Tq, :Tk] = m
    blocks = padded.view(nq, sq, nk, sk)  # (nq, sq, nk, sk)
    return blocks.nanmean(dim=(1, 3)), sq, sk  # (nq, nk)


def _ticks(labels: Sequence[str], stride: int) -> tuple[list[float], list[str]]:
    """Tick positions (in pooled cells) and labels: every token when few, else evenly spaced
    ones, labelled ``index:token`` so that a reader can find the position."""
    n = len(labels)
    if n <= MAX_TICK_LABELS and stride == 1:
        return list(range(n)), list(labels)
    step = max(1, math.ceil(n / (MAX_TICK_LABELS // 2)))
    chosen = range(0, n, step)
    return [i / stride - 0.5 + 0.5 / stride for i in chosen], [f"{i}:{labels[i]}" for i in chosen]


def _panel_inches(tokens: int, per_token: float, margin: float, rows: int, cols: int) -> float:
    """Side of a square-ish panel: grows with the tokens up to a cap, then shrinks so that
    ``rows x cols`` panels fit :data:`MAX_FIGURE_PX`; refuses when they cannot fit readably."""
    side = min(max(per_token * min(tokens, MAX_CELLS) + margin, _MIN_PANEL_IN), _MAX_PANEL_IN)
    fit = (MAX_FIGURE_PX / DPI - 1.5) / max(rows, cols)
    if fit < _MIN_PANEL_IN:
        most = int((MAX_FIGURE_PX / DPI - 1.5) // _MIN_PANEL_IN)
        raise UserError(
            f"{rows} x {cols} panels do not fit a readable picture of at most {MAX_FIGURE_PX} px a side; "
            f"expected at most {most} panels per row and column (draw fewer heads or layers)"
        )
    return min(side, fit)


def save_mask_png(
    path: str | Path,
    grids: Sequence[tuple[str, Tensor]],
    q_labels: Sequence[str],
    k_labels: Sequence[str] | None = None,
) -> Path:
    """Draw one or more named bool ``(Tq, Tk)`` masks side by side as labelled grids (PNG).

    Up to :data:`MAX_ANNOTATED` tokens each cell is written ``0`` / ``-∞``; longer sequences are
    drawn as an image (averaged in blocks past :data:`MAX_CELLS` tokens: the shade is the share of
    allowed pairs) with evenly spaced labels. The picture stays within :data:`MAX_FIGURE_PX`.

    Raises:
        ValueError: a grid does not match the labels, or there are too many grids to fit.
    """
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    if not grids:
        raise UserError("no masks to draw; expected one or more (name, (Tq, Tk) mask) pairs")
    k_labels = list(q_labels if k_labels is None else k_labels)
    q_labels = list(q_labels)
    for _, g in grids:
        _check_grid(g, q_labels, k_labels)
    n = len(grids)
    Tq, Tk = grids[0][1].shape
    size = _panel_inches(max(Tq, Tk), 0.6, 1.5, 1, n)
    fig = Figure(figsize=(size * n, size))
    axes = fig.subplots(1, n, squeeze=False)
    cmap = LinearSegmentedColormap.from_list("mask", ["#d9d9d9", "#2b6cb0"])  # blocked .. allowed
    annotate = max(Tq, Tk) <= MAX_ANNOTATED
    for ax, (name, g) in zip(axes[0], grids):
        shown, sq, sk = _pooled(g)
        ax.imshow(shown.numpy(), cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        if annotate:
            for i, row in enumerate(g.tolist()):
                for j, ok in enumerate(row):
                    ax.text(j, i, "0" if ok else "-∞", ha="center", va="center", color="white" if ok else "#555555")
        _label_axes(ax, q_labels, k_labels, sq, sk, fontsize=None if annotate else 6, rotation=45)
        ax.set_xlabel("key (attend to)")
        ax.set_ylabel("query (from)")
        ax.set_title(name if sq == sk == 1 else f"{name}\n(blocks of {sq}x{sk}: shade = share allowed)")
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# Audit pictures: the measured dependency of outputs on inputs, next to the intended mask
# ---------------------------------------------------------------------------------------------
def save_dependency_png(
    path: str | Path,
    intended: Tensor,
    measured: Sequence[tuple[str, Tensor]],
    *,
    leaks: Sequence[tuple[int, int | None]] = (),
    title: str | None = None,
) -> Path:
    """The intended bool ``(T, T)`` mask beside measured ``(T, T)`` dependency matrices.

    Measured values are drawn on a log scale (exact zeros blank); cells in ``leaks`` — pairs
    ``(i, j)`` the intended mask blocks but the model depends on — are outlined in red.
    """
    from matplotlib.colors import LinearSegmentedColormap, ListedColormap, LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    T = intended.shape[0]
    if intended.shape != (T, T):
        raise UserError(f"intended mask has shape {tuple(intended.shape)}, expected square (T, T)")
    for name, m in measured:
        if tuple(m.shape) != (T, T):
            raise UserError(f"measured matrix {name!r} has shape {tuple(m.shape)}, expected ({T}, {T})")
    labels = [str(i) for i in range(T)]
    n = 1 + len(measured)
    size = max(3.0, _panel_inches(T, 0.35, 2.0, 1, n + 1))
    fig = Figure(figsize=(size * n + 0.8 * len(measured), size))
    axes = fig.subplots(1, n, squeeze=False)
    ax = axes[0][0]
    shown, stride, _ = _pooled(intended)
    cmap = LinearSegmentedColormap.from_list("mask", ["#d9d9d9", "#2b6cb0"])
    ax.imshow(shown.numpy(), cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
    ax.set_title("intended mask (blue = may depend)")
    for ax, (name, m) in zip(axes[0][1:], measured):
        m = m.detach().double().cpu()
        if stride > 1:  # the largest value of each block: a leak must not average away
            m = torch.nn.functional.max_pool2d(m[None, None], stride, ceil_mode=True)[0, 0]
        values = m.numpy()
        positive = values[values > 0]
        if positive.size:
            norm = LogNorm(vmin=max(positive.min(), positive.max() * 1e-8), vmax=positive.max())
            shown = values.copy()
            shown[shown <= 0] = float("nan")  # exact independence: blank
            img = ax.imshow(shown, cmap="viridis", norm=norm)
            fig.colorbar(img, ax=ax, fraction=0.046, pad=0.04)
        else:
            ax.imshow(values * 0, cmap=ListedColormap(["white"]))
        for i, j in leaks:
            if j is not None:
                cell = (j // stride - 0.5, i // stride - 0.5)
                ax.add_patch(Rectangle(cell, 1, 1, fill=False, edgecolor="red", linewidth=1.5))
        ax.set_title(name if stride == 1 else f"{name} (max over {stride}x{stride} blocks)")
    for ax in axes[0]:
        _label_axes(ax, labels, labels, stride, stride, fontsize=7, rotation=0)
        ax.set_xlabel("input token j")
        ax.set_ylabel("output position i")
    if title:
        fig.suptitle(title + (f" — {len(leaks)} leaking pairs outlined in red" if leaks else ""))
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    width, height = (float(x) * DPI for x in fig.get_size_inches())
    if max(width, height) > MAX_FIGURE_PX:  # the layouts above keep within; this guards any other
        raise UserError(f"picture would be {width:.0f} x {height:.0f} px; expected at most {MAX_FIGURE_PX} px a side")
    path = Path(path)
    if not path.suffix:
        path = path.with_suffix(".png")  # what matplotlib writes for a name without a suffix: say so
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=DPI)
    except BaseException:
        path.unlink(missing_ok=True)  # no half-written picture left behind (a full disk, Ctrl-C)
        raise
    return path


# ---------------------------------------------------------------------------------------------
# Attention weights: record them from a model, draw them per layer and head
# ---------------------------------------------------------------------------------------------
ATTENTION_KINDS = ("encoder", "decoder", "cross")


@contextmanager
def record_attention(model) -> Iterator[dict[str, list[Tensor]]]:
    """Record the attention weights of every layer of an attnmask Transformer while inside.

    Yields ``{"encoder": [...], "decoder": [...], "cross": [...]}``: for each forward call of a
    layer, its weights ``(B, H, Tq, Tk)`` are appended (so after one forward, index = layer).
    The attention modules are temporarily switched to the ``reference`` kernel, the one that
    returns weights; everything is restored on exit.
    """
    rec: dict[str, list[Tensor]] = {k: [] for k in ATTENTION_KINDS}
    targets = [(layer.self_attn, "encoder") for layer in getattr(model, "encoder_layers", None) or ()]
    for layer in model.layers:
        targets.append((layer.self_attn, "decoder"))
        if layer.cross_attn is not None:
            targets.append((layer.cross_attn, "cross"))
    patched = []
    for mha, kind in targets:
        original, backend = mha.forward, mha.backend

        def forward(*args, _original=original, _kind=kind, **kwargs):
            kwargs["return_weights"] = True
            out, weights = _original(*args, **kwargs)
            rec[_kind].append(weights.detach())
            return out

        mha.forward, mha.backend = forward, "reference"
        patched.append((mha, backend))
    try:
        yield rec
    finally:
        for mha, backend in patched:
            del mha.forward  # back to the class's method
            mha.backend = backend


def save_attention_png(
    path: str | Path,
    weights: Sequence[Tensor],
    q_labels: Sequence[str],
    k_labels: Sequence[str],
    *,
    mask: Tensor | None = None,
    title: str | None = None,
    max_heads: int | None = None,
) -> Path:
    """Heatmaps of attention weights, one row per layer and one column per head, with the
    bool ``(Tq, Tk)`` mask (True = may attend) drawn beside the first row.

    ``weights`` holds one ``(H, Tq, Tk)`` tensor per layer (weights of one sequence).
    """
    from matplotlib.colors import LinearSegmentedColormap
    from matplotlib.figure import Figure

    if not weights:
        raise UserError("no attention weights to draw; expected one (H, Tq, Tk) tensor per layer")
    q_labels, k_labels = list(q_labels), list(k_labels)
    for layer, w in enumerate(weights):
        if w.dim() != 3 or tuple(w.shape[1:]) != (len(q_labels), len(k_labels)):
            raise UserError(
                f"layer {layer} weights have shape {tuple(w.shape)}, expected (H, Tq={len(q_labels)}, "
                f"Tk={len(k_labels)}) matching the labels"
            )
    if mask is not None:
        _check_grid(mask, q_labels, k_labels)
    L, H = len(weights), weights[0].shape[0]
    H = min(H, max_heads) if max_heads else H
    cols = H + (1 if mask is not None else 0)
    Tq, Tk = len(q_labels), len(k_labels)
    # panel size follows the token counts (so labels stay readable and cells square) up to a cap;
    # past MAX_CELLS tokens the weights are averaged in blocks
    side = _panel_inches(max(Tq, Tk), 0.22, 0.9, L, cols)  # the longer axis; the other in proportion
    longest = min(max(Tq, Tk, 1), MAX_CELLS)
    width = max(side * min(Tk, MAX_CELLS) / longest, _MIN_PANEL_IN)
    height = max(side * min(Tq, MAX_CELLS) / longest, _MIN_PANEL_IN)
    fig = Figure(figsize=(width * cols + 1.2, height * L + 0.5), layout="constrained")
    axes = fig.subplots(L, cols, squeeze=False)
    # one colour scale for the whole figure, so heads compare; weights are in [0, 1]
    vmax = max(float(w[:H].max()) for w in weights) or 1.0
    img = None
    for layer, w in enumerate(weights):
        for h in range(H):
            ax = axes[layer][h]
            shown, sq, sk = _pooled(w[h])
            img = ax.imshow(shown.numpy(), cmap="Blues", vmin=0.0, vmax=vmax, interpolation="nearest")
            pooled = "" if sq == sk == 1 else f" (mean of {sq}x{sk})"
            ax.set_title(f"layer {layer} head {h}{pooled}", fontsize=8)
            _label_axes(ax, q_labels, k_labels, sq, sk)
        if mask is not None:
            ax = axes[layer][H]
            if layer == 0:
                shown, sq, sk = _pooled(mask)
                cmap = LinearSegmentedColormap.from_list("mask", ["#d9d9d9", "#2b6cb0"])
                ax.imshow(shown.numpy(), cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
                ax.set_title("mask (blue = may attend)", fontsize=8)
                _label_axes(ax, q_labels, k_labels, sq, sk)
            else:
                ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.colorbar(img, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01, label="attention weight")
    return _save(fig, path)


def _label_axes(
    ax,
    q_labels: Sequence[str],
    k_labels: Sequence[str],
    sq: int = 1,
    sk: int = 1,
    *,
    fontsize: float | None = 6,
    rotation: float = 90,
) -> None:
    """Token labels on a panel whose cells are blocks of ``sq x sk`` tokens."""
    xs, xl = _ticks(k_labels, sk)
    ys, yl = _ticks(q_labels, sq)
    ax.set_xticks(xs, xl, rotation=rotation, fontsize=fontsize, ha="right" if rotation not in (0, 90) else "center")
    ax.set_yticks(ys, yl, fontsize=fontsize)

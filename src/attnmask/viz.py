"""Pictures of masks, of attention weights and of audited dependencies: what people would rather look at.

Text grids follow the seeds' notation: rows are queries ("from"), columns are keys ("to"),
cells are ``0`` (may attend) and ``-∞`` (blocked), or ``■`` / ``·`` with ``style="symbols"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from torch import Tensor

CELL = {"values": ("0", "-∞"), "symbols": ("■", "·")}


def _check_grid(allowed: Tensor, q_labels: Sequence[str], k_labels: Sequence[str]) -> None:
    if allowed.dim() != 2:
        raise ValueError(f"a mask grid needs a 2-D (Tq, Tk) mask, got shape {tuple(allowed.shape)}")
    if (len(q_labels), len(k_labels)) != tuple(allowed.shape):
        raise ValueError(
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
        raise ValueError(f"style must be one of {sorted(CELL)}, got {style!r}")
    k_labels = list(q_labels if k_labels is None else k_labels)
    q_labels = list(q_labels)
    _check_grid(allowed, q_labels, k_labels)
    yes, no = CELL[style]
    row_w = max([len(s) for s in q_labels] + [0])
    col_w = max([len(s) for s in k_labels] + [len(yes), len(no)])
    lines = []
    if title:
        lines.append(title)
    lines.append(" " * row_w + " │ " + " ".join(s.center(col_w) for s in k_labels))
    lines.append("─" * row_w + "─┼─" + "─" * ((col_w + 1) * len(k_labels) - 1))
    for label, row in zip(q_labels, allowed.tolist()):
        cells = " ".join((yes if a else no).center(col_w) for a in row)
        lines.append(label.rjust(row_w) + " │ " + cells)
    return "\n".join(lines)


def save_mask_png(
    path: str | Path,
    grids: Sequence[tuple[str, Tensor]],
    q_labels: Sequence[str],
    k_labels: Sequence[str] | None = None,
) -> Path:
    """Draw one or more named bool ``(Tq, Tk)`` masks side by side as labelled grids (PNG)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    k_labels = list(q_labels if k_labels is None else k_labels)
    for _, g in grids:
        _check_grid(g, q_labels, k_labels)
    n = len(grids)
    Tq, Tk = grids[0][1].shape
    size = max(2.5, 0.6 * max(Tq, Tk) + 1.5)
    fig = Figure(figsize=(size * n, size))
    axes = fig.subplots(1, n, squeeze=False)
    cmap = ListedColormap(["#d9d9d9", "#2b6cb0"])  # blocked, allowed
    for ax, (name, g) in zip(axes[0], grids):
        ax.imshow(g.int().numpy(), cmap=cmap, vmin=0, vmax=1)
        for i in range(Tq):
            for j in range(Tk):
                ok = bool(g[i, j])
                ax.text(j, i, "0" if ok else "-∞", ha="center", va="center", color="white" if ok else "#555555")
        ax.set_xticks(range(Tk), k_labels, rotation=45, ha="right")
        ax.set_yticks(range(Tq), list(q_labels))
        ax.set_xlabel("key (attend to)")
        ax.set_ylabel("query (from)")
        ax.set_title(name)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


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
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    T = intended.shape[0]
    if intended.shape != (T, T):
        raise ValueError(f"intended mask has shape {tuple(intended.shape)}, expected square (T, T)")
    for name, m in measured:
        if tuple(m.shape) != (T, T):
            raise ValueError(f"measured matrix {name!r} has shape {tuple(m.shape)}, expected ({T}, {T})")
    labels = [str(i) for i in range(T)]
    n = 1 + len(measured)
    size = max(3.0, 0.35 * T + 2.0)
    fig = Figure(figsize=(size * n + 0.8 * len(measured), size))
    axes = fig.subplots(1, n, squeeze=False)
    ax = axes[0][0]
    ax.imshow(intended.int().numpy(), cmap=ListedColormap(["#d9d9d9", "#2b6cb0"]), vmin=0, vmax=1)
    ax.set_title("intended mask (blue = may depend)")
    for ax, (name, m) in zip(axes[0][1:], measured):
        values = m.detach().double().cpu().numpy()
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
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
        ax.set_title(name)
    for ax in axes[0]:
        ax.set_xticks(range(T), labels)
        ax.set_yticks(range(T), labels)
        ax.set_xlabel("input token j")
        ax.set_ylabel("output position i")
        ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title + (f" — {len(leaks)} leaking pairs outlined in red" if leaks else ""))
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
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
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    if not weights:
        raise ValueError("no attention weights to draw; expected one (H, Tq, Tk) tensor per layer")
    q_labels, k_labels = list(q_labels), list(k_labels)
    for layer, w in enumerate(weights):
        if w.dim() != 3 or tuple(w.shape[1:]) != (len(q_labels), len(k_labels)):
            raise ValueError(
                f"layer {layer} weights have shape {tuple(w.shape)}, expected (H, Tq={len(q_labels)}, "
                f"Tk={len(k_labels)}) matching the labels"
            )
    if mask is not None:
        _check_grid(mask, q_labels, k_labels)
    L, H = len(weights), weights[0].shape[0]
    H = min(H, max_heads) if max_heads else H
    cols = H + (1 if mask is not None else 0)
    Tq, Tk = len(q_labels), len(k_labels)
    # panel size follows the token counts, so labels stay readable and cells stay square
    width, height = 0.22 * Tk + 0.9, 0.22 * Tq + 0.9
    fig = Figure(figsize=(width * cols + 1.2, height * L + 0.5), layout="constrained")
    axes = fig.subplots(L, cols, squeeze=False)
    # one colour scale for the whole figure, so heads compare; weights are in [0, 1]
    vmax = max(float(w[:H].max()) for w in weights) or 1.0
    img = None
    for layer, w in enumerate(weights):
        for h in range(H):
            ax = axes[layer][h]
            img = ax.imshow(w[h].detach().float().cpu().numpy(), cmap="Blues", vmin=0.0, vmax=vmax)
            ax.set_title(f"layer {layer} head {h}", fontsize=8)
            _label_axes(ax, q_labels, k_labels)
        if mask is not None:
            ax = axes[layer][H]
            if layer == 0:
                ax.imshow(mask.int().cpu().numpy(), cmap=ListedColormap(["#d9d9d9", "#2b6cb0"]), vmin=0, vmax=1)
                ax.set_title("mask (blue = may attend)", fontsize=8)
                _label_axes(ax, q_labels, k_labels)
            else:
                ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.colorbar(img, ax=axes.ravel().tolist(), fraction=0.02, pad=0.01, label="attention weight")
    return _save(fig, path)


def _label_axes(ax, q_labels: Sequence[str], k_labels: Sequence[str]) -> None:
    ax.set_xticks(range(len(k_labels)), k_labels, rotation=90, fontsize=6)
    ax.set_yticks(range(len(q_labels)), q_labels, fontsize=6)

"""Pictures of masks (and, with matplotlib, of attention): what people would rather look at.

Text grids follow the seeds' notation: rows are queries ("from"), columns are keys ("to"),
cells are ``0`` (may attend) and ``-∞`` (blocked), or ``■`` / ``·`` with ``style="symbols"``.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    k_labels = list(q_labels if k_labels is None else k_labels)
    for _, g in grids:
        _check_grid(g, q_labels, k_labels)
    n = len(grids)
    Tq, Tk = grids[0][1].shape
    size = max(2.5, 0.6 * max(Tq, Tk) + 1.5)
    fig, axes = plt.subplots(1, n, figsize=(size * n, size), squeeze=False)
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
    plt.close(fig)
    return path

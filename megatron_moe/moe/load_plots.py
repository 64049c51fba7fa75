"""Expert-load pictures from routing counts (matplotlib, no pyplot state, Agg canvas).

* `heatmap_figure`: layer x expert share of one iteration's assignments, the view of Pro-Prophet
  Fig. 3 (skewed, layer-specific expert loads).
* `share_figure`: every expert's share of its layer over iterations, the view of FlexMoE Fig. 3(b)
  (loads drift during training).
* `placement_figure`: a layer's vExpert slots (EP rank x slot -> expert held, FlexMoE / EPLB).

Shares are percentages of a layer's assignments, so layers and runs of any size compare; a
perfectly balanced layer has 100 / E everywhere.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

MAX_ANNOTATED = 16  # write the numbers into the heatmap cells / list experts in a legend up to this many


def shares(load: np.ndarray) -> np.ndarray:
    """[..., E] counts -> % of the sum over E (0 where a row has no assignments)."""
    load = np.asarray(load, dtype=np.float64)
    total = load.sum(axis=-1, keepdims=True)
    return np.divide(100.0 * load, total, out=np.zeros_like(load), where=total > 0)


def _layer_names(num_layers: int, layer_indices: Optional[Sequence[int]]) -> list:
    if layer_indices is None:
        return [f"MoE {i}" for i in range(num_layers)]
    return [f"layer {i}" for i in layer_indices]


def _expert_colors(num_experts: int) -> list:
    if num_experts <= 10:
        return [f"C{e}" for e in range(num_experts)]
    if num_experts <= 20:
        return [colormaps["tab20"](e) for e in range(num_experts)]
    return [colormaps["viridis"](e / (num_experts - 1)) for e in range(num_experts)]


def heatmap_figure(load: np.ndarray, iteration: int, layer_indices: Optional[Sequence[int]] = None) -> Figure:
    """load [L, E] assignments of one iteration -> heatmap of each expert's share of its layer."""
    share = shares(load)
    num_layers, num_experts = share.shape
    fig = Figure(figsize=(min(16.0, max(5.0, 1.0 + 0.5 * num_experts)), min(12.0, max(2.5, 1.2 + 0.45 * num_layers))),
                 dpi=100)
    ax = fig.add_subplot()
    image = ax.imshow(share, cmap="viridis", aspect="auto", vmin=0.0)
    fig.colorbar(image, ax=ax, label="share of layer's assignments (%)")
    ax.set_xlabel("expert")
    ax.set_yticks(range(num_layers), _layer_names(num_layers, layer_indices))
    if num_experts <= 32:
        ax.set_xticks(range(num_experts))
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.set_title(f"Expert load, iteration {iteration} (uniform = {100.0 / num_experts:.1f}%)")
    if num_experts <= MAX_ANNOTATED and num_layers <= 32:
        threshold = 0.6 * share.max() if share.max() > 0 else 1.0
        for (layer, expert), value in np.ndenumerate(share):
            ax.text(expert, layer, f"{value:.0f}", ha="center", va="center", fontsize=8,
                    color="black" if value > threshold else "white")
    fig.tight_layout()
    return fig


def placement_figure(slots: np.ndarray, layer_index: int, iteration: int) -> Figure:
    """slots Int[ep, V] (-1 free) -> one cell per (EP rank, slot), coloured and labelled by expert."""
    slots = np.asarray(slots)
    ranks, per_rank = slots.shape
    num_experts = int(slots.max()) + 1
    fig = Figure(figsize=(min(16.0, max(4.0, 1.5 + 0.6 * per_rank)), min(12.0, max(2.5, 1.0 + 0.45 * ranks))), dpi=100)
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_less(slots, 0), cmap="viridis", aspect="auto", vmin=0, vmax=max(num_experts - 1, 1))
    fig.colorbar(image, ax=ax, label="expert")
    ax.set_xlabel("slot")
    ax.set_ylabel("EP rank")
    ax.set_xticks(range(per_rank))
    ax.set_yticks(range(ranks))
    if ranks * per_rank <= 256:
        for (rank, slot), expert in np.ndenumerate(slots):
            ax.text(slot, rank, "free" if expert < 0 else str(expert), ha="center", va="center", fontsize=8,
                    color="black" if expert < 0 or expert > 0.6 * num_experts else "white")
    ax.set_title(f"vExpert slots, layer {layer_index}, after iteration {iteration}")
    fig.tight_layout()
    return fig


def share_figure(iterations: np.ndarray, load: np.ndarray, layer_indices: Optional[Sequence[int]] = None) -> Figure:
    """iterations [I], load [I, L, E] -> one panel per layer: each expert's share over iterations."""
    share = shares(load)
    _, num_layers, num_experts = share.shape
    cols = min(num_layers, 2)
    rows = math.ceil(num_layers / cols)
    fig = Figure(figsize=(6.0 * cols + (1.4 if num_experts <= MAX_ANNOTATED else 0.0), 3.2 * rows), dpi=100,
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = _expert_colors(num_experts)
    for layer, name in enumerate(_layer_names(num_layers, layer_indices)):
        ax = axes[layer // cols][layer % cols]
        for e in range(num_experts):
            ax.plot(iterations, share[:, layer, e], color=colors[e], linewidth=1.2, label=f"expert {e}")
        ax.axhline(100.0 / num_experts, color="gray", linestyle="--", linewidth=1.0, label="uniform")
        ax.set_title(name)
        ax.set_ylabel("share (%)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("iteration")
    for empty in range(num_layers, rows * cols):
        axes[empty // cols][empty % cols].set_visible(False)
    if num_experts <= MAX_ANNOTATED:
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", fontsize=8)
    return fig


def figure_rgb(fig: Figure) -> np.ndarray:
    """Render a figure to uint8 [H, W, 3] (for TensorBoard)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_png(fig: Figure, path: str) -> None:
    FigureCanvasAgg(fig).print_png(path)

"""Draws docs/img/layouts.png, the buffer-layout figure of docs/formats.md.

    python scripts/draw_layouts.py

A small x of M = 8 rows and K = 12 columns (the reduction dim along K), drawn as the formats lay
it out: each colour is one scale (one entry of scale_inv), each cell one code of the data buffer.
Block sizes are shrunk (blocks of 4, tiles of 4 x 4) so the picture stays readable; the real
sizes are in the table beside the figure.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

M, K, BLOCK = 8, 12, 4
# 60 distinct colours, so no two scales of one panel (at most 24 here) share one.
PALETTE = np.concatenate([plt.get_cmap(name)(np.arange(20)) for name in ("tab20", "tab20b", "tab20c")])
OUT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "img" / "layouts.png"


def _panel(axis, scale_ids: np.ndarray, title: str, rows: str, cols: str, note: str) -> None:
    """One buffer: a grid of codes coloured by the scale each one uses."""
    colours = PALETTE[scale_ids % len(PALETTE)]
    axis.imshow(colours, aspect="equal", interpolation="nearest")
    height, width = scale_ids.shape
    axis.set_xticks(np.arange(-0.5, width, 1), minor=True)
    axis.set_yticks(np.arange(-0.5, height, 1), minor=True)
    axis.grid(which="minor", color="white", linewidth=1)
    axis.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    axis.set_xlabel(cols, fontsize=9)
    axis.set_ylabel(rows, fontsize=9)
    axis.set_title(title, fontsize=10)
    axis.text(0.5, -0.22, note, transform=axis.transAxes, ha="center", va="top", fontsize=8, wrap=True)


def main() -> None:
    rows, cols = np.indices((M, K))
    figure, axes = plt.subplots(2, 3, figsize=(9.5, 6.4))
    _panel(
        axes[0, 0],
        np.zeros((M, K), dtype=int),
        "per-tensor FP8: rowwise (M, K)",
        "M (tokens)",
        "K (reduction)",
        "one scale for the whole tensor\n(scale_inv: fp32, 0-d)",
    )
    _panel(
        axes[0, 1],
        rows * (K // BLOCK) + cols // BLOCK,
        "1-D blocks: rowwise (M, K)",
        "M",
        "K",
        "one scale per row and block of K\n(scale_inv: (M, K / block))",
    )
    _panel(
        axes[0, 2],
        cols.T * (M // BLOCK) + rows.T // BLOCK,
        "1-D blocks: columnwise = x^T (K, M)",
        "K",
        "M",
        "blocks run along M: other numbers than rowwise\n(scale_inv: (K, M / block))",
    )
    tiles = (rows // BLOCK) * (K // BLOCK) + cols // BLOCK
    _panel(
        axes[1, 0],
        tiles,
        "2-D tiles: rowwise (M, K)",
        "M",
        "K",
        "one scale per tile\n(scale_inv: (M / tile, K / tile))",
    )
    _panel(
        axes[1, 1],
        tiles.T,
        "2-D tiles: columnwise = x^T (K, M)",
        "K",
        "M",
        "the same tiles, transposed: derived losslessly\n(update_usage(columnwise=True))",
    )
    packed = np.repeat(rows * (K // BLOCK) + cols // BLOCK, 1, axis=1)[:, ::2]
    _panel(
        axes[1, 2],
        packed,
        "NVFP4 1x16: rowwise data (M, K / 2) bytes",
        "M",
        "K / 2 (two 4-bit codes per byte)",
        "E4M3 block scales (M, K / 16) times one fp32\ntensor scale from the global amax",
    )
    figure.suptitle(
        "Quantized buffers of an 8 x 12 tensor (blocks of 4 drawn; real: 32, 128, 16): one colour = one scale",
        fontsize=11,
    )
    figure.tight_layout(rect=(0, 0.02, 1, 0.95), h_pad=4)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

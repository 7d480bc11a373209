"""Addition accuracy heatmap per operand-length pair (TAPE Fig. 2, arXiv 2501.00712).

    python -m copejax.plots.addition --workdir=workdirs/add --out=workdirs/add/grid.png

Reads the last ``eval/<split>/accuracy/<la>x<lb>`` record of ``<workdir>/metrics.jsonl``
(the numbers of :func:`copejax.data.addition.accuracy_grid`) and draws it.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from absl import app, flags

from copejax.data.addition import accuracy_grid
from copejax.runtime.metrics import read_jsonl


def last_grid(records: list[dict[str, float]], split: str) -> tuple[int, np.ndarray]:
    """(step, [M, M] accuracy) of the last record holding ``eval/<split>/accuracy/..x..``."""
    prefix = f"eval/{split}/"
    for record in reversed(records):
        pairs = {
            k.removeprefix(prefix): v
            for k, v in record.items()
            if k.startswith(prefix + "accuracy/")
        }
        if pairs:
            size = max(int(n) for k in pairs for n in k.removeprefix("accuracy/").split("x"))
            return int(record.get("step", 0)), accuracy_grid(pairs, size)
    raise ValueError(f"no eval/{split}/accuracy/<la>x<lb> record in the metrics")


def write_heatmap(grid: np.ndarray, path: str | os.PathLike, title: str = "") -> None:
    """Draws accuracy [len a - 1, len b - 1] as a heatmap (NaN cells left blank) to ``path``."""
    size = grid.shape[0]
    fig, ax = plt.subplots(figsize=(4 + size / 8, 3.5 + size / 8))
    image = ax.imshow(grid, origin="lower", vmin=0.0, vmax=1.0, cmap="viridis")
    ticks = np.arange(0, size, max(1, size // 10))
    ax.set_xticks(ticks, labels=ticks + 1)
    ax.set_yticks(ticks, labels=ticks + 1)
    ax.set_xlabel("length of b")
    ax.set_ylabel("length of a")
    ax.set_title(title or f"exact-match accuracy (mean {np.nanmean(grid):.1%})")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    del argv
    values = flags.FLAGS
    step, grid = last_grid(read_jsonl(os.path.join(values.workdir, "metrics.jsonl")), values.split)
    write_heatmap(grid, values.out, f"step {step}: mean accuracy {np.nanmean(grid):.1%}")


if __name__ == "__main__":  # flags only when run as a program: no clashes with copejax.main
    flags.DEFINE_string("workdir", None, "Training workdir holding metrics.jsonl.")
    flags.DEFINE_string("out", None, "PNG file to write.")
    flags.DEFINE_string("split", "grid", "Eval split whose per-pair accuracy is drawn.")
    flags.mark_flags_as_required(["workdir", "out"])
    app.run(main)

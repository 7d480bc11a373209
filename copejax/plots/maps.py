"""Attention, CoPE gate and CoPE position-only attention maps for a text (CoPE Figures 4 and 6,
arXiv 2405.18719), as heatmaps with the tokens on the axes.

    python -m copejax.plots.maps --workdir=workdirs/lm_cope --text="ROMEO. O, she doth teach" \
        --layer=0 --head=0 [--kinds=attention,gates,position_attention] [--out=maps.png]

The model runs once with ``mutable=["intermediates"]``; attention.py sows
``attention_weights`` for every scheme and CoPE sows ``gates_BNTS``, ``positions_BNTS`` and
``position_attention_BNTS`` (the softmax of the CoPE term alone). Row i is query token i, column
j key token j; entries a query may not see (j > i) are blank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")

import jax
import matplotlib.pyplot as plt
import numpy as np
from absl import app, flags

from copejax.config import command_line
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer

KINDS = {
    "attention": "attention_weights",
    "gates": "gates_BNTS",
    "positions": "positions_BNTS",
    "position_attention": "position_attention_BNTS",
}
TITLES = {
    "attention": "attention",
    "gates": "CoPE gates g_ij",
    "positions": "CoPE positions p_ij",
    "position_attention": "position-only attention",
}


def sown_maps(
    model_config: ModelConfig, params: Any, tokens_T: np.ndarray
) -> dict[str, list[np.ndarray]]:
    """Runs the model on one sequence; returns sown name -> per-layer arrays of shape [N, T, T].

    A module inside ``block_<i>`` gives layer i's array; a module shared by the layers (sown
    once per layer call) gives a tuple whose entry i is layer i's.
    """
    tokens_1T = np.asarray(tokens_T, np.int32)[None]
    positions_1T = np.arange(tokens_1T.shape[1], dtype=np.int32)[None]
    _, state = Transformer(model_config).apply(
        {"params": params}, tokens_1T, positions_1T, mutable=["intermediates"]
    )
    per_layer: dict[str, dict[int, np.ndarray]] = {}
    flat = jax.tree_util.tree_flatten_with_path(
        state["intermediates"], is_leaf=lambda x: isinstance(x, tuple)
    )[0]
    for path, values in flat:
        keys = [getattr(p, "key", "") for p in path]
        name = keys[-1]
        blocks = [int(k.removeprefix("block_")) for k in keys if str(k).startswith("block_")]
        for i, value in enumerate(values):
            layer = blocks[0] if blocks else i
            per_layer.setdefault(name, {})[layer] = np.asarray(value)[0]
    return {name: [layers[i] for i in sorted(layers)] for name, layers in per_layer.items()}


def draw_maps(
    maps: Sequence[tuple[str, np.ndarray]],
    labels: Sequence[str],
    path: str | os.PathLike,
    panel_inches: float | None = None,
    dpi: int = 100,
) -> None:
    """Writes one heatmap panel per (title, [T, T] matrix) side by side, tokens on both axes.

    The figure is ``len(maps) * panel_inches`` by ``panel_inches`` inches at ``dpi`` (default
    panel size grows with T so that the token labels stay readable).
    """
    length = len(labels)
    size = panel_inches or max(4.0, 0.22 * length + 1.5)
    fig, axes = plt.subplots(1, len(maps), figsize=(size * len(maps), size), squeeze=False)
    causal_TT = np.tril(np.ones((length, length), bool))
    for axis, (title, matrix_TT) in zip(axes[0], maps, strict=True):
        shown = np.where(causal_TT, np.asarray(matrix_TT, np.float32), np.nan)
        image = axis.imshow(shown, cmap="viridis", interpolation="nearest")
        axis.set_title(title, fontsize=9)
        axis.set_xticks(range(length), labels, fontsize=6, rotation=90)
        axis.set_yticks(range(length), labels, fontsize=6)
        axis.set_xlabel("key", fontsize=8)
        axis.set_ylabel("query", fontsize=8)
        fig.colorbar(image, ax=axis, fraction=0.046, pad=0.03)
    fig.subplots_adjust(left=0.08, right=0.96, bottom=0.15, top=0.92, wspace=0.35)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def render(
    model_config: ModelConfig,
    params: Any,
    tokens_T: np.ndarray,
    labels: Sequence[str],
    *,
    layer: int,
    head: int,
    kinds: Sequence[str],
    path: str | os.PathLike,
    panel_inches: float | None = None,
    dpi: int = 100,
) -> None:
    """Runs the model on ``tokens_T`` and draws the ``kinds`` maps of ``layer`` / ``head``.

    Raises:
      ValueError: an unknown kind, a kind this scheme does not sow (e.g. gates without CoPE),
        or a layer or head out of range.
    """
    maps = sown_maps(model_config, params, tokens_T)
    panels = []
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown map kind {kind!r}; allowed: {sorted(KINDS)}")
        if KINDS[kind] not in maps:
            available = sorted(k for k, v in KINDS.items() if v in maps)
            raise ValueError(
                f"scheme {model_config.position!r} sows no {KINDS[kind]!r} (kind {kind!r}); "
                f"available kinds: {available}"
            )
        layers = maps[KINDS[kind]]
        if not 0 <= layer < len(layers):
            raise ValueError(f"layer must be in [0, {len(layers)}), got {layer}")
        if not 0 <= head < layers[layer].shape[0]:
            raise ValueError(f"head must be in [0, {layers[layer].shape[0]}), got {head}")
        panels.append((f"{TITLES[kind]} (layer {layer}, head {head})", layers[layer][head]))
    draw_maps(panels, labels, path, panel_inches, dpi)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from copejax.data import _tokenizers as tok
    from copejax.training.trained_run import load_run

    run = load_run(flags.FLAGS.workdir, flags.FLAGS.step)
    if not hasattr(run.task, "text_tokenizer"):
        raise ValueError(
            f"{flags.FLAGS.workdir} trained task {run.task.name!r}; maps of a --text need an "
            "'lm' run (configs/lm.py)"
        )
    tokenizer = run.task.text_tokenizer()
    tokens_T = np.concatenate([[tok.BOS_ID], tokenizer.encode(flags.FLAGS.text)]).astype(np.int32)
    out = flags.FLAGS.out or os.path.join(
        flags.FLAGS.workdir, f"maps_l{flags.FLAGS.layer}_h{flags.FLAGS.head}.png"
    )
    render(
        run.model_config, run.params, tokens_T, tokenizer.token_strings(tokens_T),
        layer=flags.FLAGS.layer, head=flags.FLAGS.head, kinds=flags.FLAGS.kinds, path=out,
    )  # fmt: skip
    print(f"wrote {out}", flush=True)


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so that importing this
    module next to other tools defines no clashing flags)."""
    flags.DEFINE_string("workdir", None, "Workdir of a training run.")
    flags.DEFINE_string("text", None, "Text to run the model on (lm task).")
    flags.DEFINE_integer("layer", 0, "Layer.")
    flags.DEFINE_integer("head", 0, "Head.")
    flags.DEFINE_list("kinds", ["attention"], f"Maps, among {sorted(KINDS)}.")
    flags.DEFINE_string("out", None, "PNG path (default <workdir>/maps_l<L>_h<H>.png).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
    flags.mark_flags_as_required(["workdir", "text"])


if __name__ == "__main__":
    define_flags()
    app.run(command_line.one_line_errors(main))

"""``python -m copejax.positions``: a table of every registered scheme."""

from __future__ import annotations

import dataclasses

from copejax.model.attention_paths import auto_blockwise_start
from copejax.model.config import KERNEL_SITES
from copejax.model.kernel_terms import kernel_refusal
from copejax.positions import registry
from copejax.positions.base import PositionScheme


def attention_paths(cls: type[PositionScheme]) -> str:
    """The attention paths a scheme runs on (``model.attention_impl``; the fused kernels with
    the backends whose kernels cover its default options: every covered scheme runs on the
    GPU's and the TPU's), and the blockwise
    engine's backwards: flash (custom VJP) and remat for every scheme (flash for a walk carry
    or stick-breaking only outside windows; ``auto`` keeps remat for PaTH's carry, see
    ``copejax.ops.engine``), and what ``auto`` takes on a CPU (``choose_impl``; on a GPU it
    also weighs the (B, N, T, S) bytes)."""
    paths = ["naive", "blockwise (flash / remat)"]
    extra = set(cls.sites) - KERNEL_SITES
    if not extra or (extra == {"bias"} and cls.position_only_bias):
        paths.append("dot_product_attention")
    scheme = cls()
    if kernel_refusal(scheme) is None:  # with its default options
        paths.append("kernel (GPU, TPU)")
    auto = f"auto on CPU: naive below {auto_blockwise_start(cls)} keys, blockwise from there"
    if cls.max_engine_block is not None:
        auto += f" in blocks of at most {cls.max_engine_block}"
    return f"{', '.join(paths)}; {auto}"


def table() -> str:
    """Markdown table: name, sites, attention paths, options with defaults, paper."""
    rows = [
        "| scheme | sites | attention paths | options (defaults) | paper |",
        "|---|---|---|---|---|",
    ]
    for name in registry.names():
        cls = registry.get(name)
        options = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls)) or "-"
        sites = ", ".join(cls.sites) or "-"
        rows.append(f"| `{name}` | {sites} | {attention_paths(cls)} | {options} | {cls.paper} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())

"""What :mod:`experiments.kernel_ptx` reads from a compiled kernel: the PTX of one entry, its
instruction counts, ptxas's resource report, and the table row it prints.

Shape letters: none (text in, numbers out).
"""

from __future__ import annotations

import re

# (column, width) of the printed table.
COLUMNS = (
    ("kernel", 26),
    ("warps", 5),
    ("compile_s", 9),
    ("regs", 4),
    ("spill_st", 8),
    ("spill_ld", 8),
    ("wgmma", 5),
    ("mma", 4),
    ("fma_f32", 7),
    ("ptx_KB", 6),
)


def entry_ptx(ptx: str, name: str) -> str:
    """The text of the PTX ``.entry name`` (to the next entry or the end); '' if absent."""
    starts = [m.start() for m in re.finditer(r"^\.(?:visible )?\.entry ", ptx, re.M)]
    for i, start in enumerate(starts):
        found = re.match(r"\.(?:visible )?\.entry\s+([\w$.]+)", ptx[start : start + 400])
        if found and found.group(1) == name:
            return ptx[start : starts[i + 1] if i + 1 < len(starts) else len(ptx)]
    return ""


def ptx_counts(body: str) -> dict[str, int]:
    """Hopper matrix instructions (``wgmma``), older ones (``mma.sync``) and float32 FMAs: a
    float32 matmul at ``Precision.HIGHEST`` shows as thousands of FMAs and no matrix op."""
    return {
        "wgmma": len(re.findall(r"\bwgmma\.mma_async", body)),
        "mma": len(re.findall(r"\bmma\.sync", body)),
        "fma_f32": len(re.findall(r"\bfma\.rn(?:\.ftz)?\.f32\b", body)),
        "ptx_bytes": len(body),
    }


def ptxas_resources(log: str, name: str) -> dict[str, int]:
    """Registers, stack and spill bytes per thread of entry ``name`` from ``ptxas -v``."""
    out: dict[str, int] = {}
    for block in re.split(r"ptxas info\s+: Compiling entry function ", log)[1:]:
        if not block.startswith(f"'{name}'"):
            continue
        found = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block
        )
        if found:
            out.update(
                stack=int(found.group(1)),
                spill_st=int(found.group(2)),
                spill_ld=int(found.group(3)),
            )
        found = re.search(r"Used (\d+) registers", block)
        if found:
            out["regs"] = int(found.group(1))
    return out


def table(rows: list[dict]) -> str:
    """The rows as a fixed-width table (``-`` where a value is missing), errors below."""
    lines = [" ".join(f"{column:>{width}}" for column, width in COLUMNS)]
    for row in rows:
        values = {
            **{column: row.get(column, "-") for column, _ in COLUMNS},
            "kernel": row["kernel"],
            "warps": row.get("num_warps", "-"),
            "compile_s": f"{row['compile_s']:.1f}" if row.get("compile_s") is not None else "-",
            "ptx_KB": f"{row['ptx_bytes'] / 1024:.0f}" if "ptx_bytes" in row else "-",
        }
        lines.append(" ".join(f"{values[column]!s:>{width}}" for column, width in COLUMNS))
        if row.get("error"):
            lines.append(f"  error: {row['error']}")
    return "\n".join(lines)

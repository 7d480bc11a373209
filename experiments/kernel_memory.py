"""XLA's temporary memory of one attention layer's forward + backward on the fused kernels, as
an H100 compiles it, from a CPU (issue 45's memory target).

    .venv-ptx/bin/python -m experiments.kernel_memory                 # T = 16384, both shapes
    .venv-ptx/bin/python -m experiments.kernel_memory --lengths 4096 --shapes 2,4,64
    .venv-ptx/bin/python -m experiments.kernel_memory --schemes path --merge   # PaTH's rows only
    python -m experiments.kernel_memory --render experiments/results/kernel_memory.json

Issue 45 asks for "no (T, S) buffer" and "XLA temporaries at 16K within 1.2x of cuDNN nope's".
Both are properties of the compiled program, not of a run: XLA plans every buffer when it
compiles, and ``memory_analysis()`` reports the plan. So this needs no GPU. It builds each arm's
layer (``experiments.bench_measure``'s, bfloat16), compiles it deviceless for an H100 with the
GPU machine's jax 0.11.2 (``experiments.kernel_ptx``'s route and ``.venv-ptx``), and records
per arm:

- **temp**: ``temp_size_in_bytes``, the buffers XLA allocates besides arguments and outputs;
- **ratio**: temp over cuDNN nope's (the ``dpa`` arm: ``jax.nn.dot_product_attention``,
  ``implementation="cudnn"``), the issue's target being at most 1.2x;
- **largest**: the largest array in the optimized HLO (arguments, outputs and temporaries);
- **(T, S)**: the arrays with two axes at least T long, which a (T, S) buffer has: none is the
  target. (A Triton kernel's own tiles live in registers and shared memory, outside XLA.)

Cross-check at T = 4096, (B, N, H) = (2, 4, 64): the H100 run of
``experiments/results/bench_kernels_gpu.md`` reported 32 / 33 / 48 MiB for the nope / FoX /
stick-breaking kernels and 104 MiB for cuDNN (then with a (B, 1, T, S) mask). That program
compiled here gave the same kernel figures and 96 MiB for cuDNN, whose workspace is sized
against a device: ratios to cuDNN here are if anything larger than on the device. Today's
layer (its cotangent an argument, cuDNN's causal flag instead of the mask) gives 36 / 37 / 48
and 44 MiB.

Writes ``kernel_memory.md`` and ``kernel_memory.json`` under ``--out_dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import time
from pathlib import Path
from typing import Any

# The arms: cuDNN's fused nope, then each scheme on its kernels (attention_impl="kernel").
BASELINE = "dpa"
KERNEL_SCHEMES = (
    "nope",
    "alibi",
    "t5",
    "kerple",
    "fox",
    "stickbreaking",
    "cope",
    "selective",
    "path",
    "relative",
    "relative_capped",
)
SHAPES = ((2, 4, 64), (4, 16, 128))  # (B, N, H): issue 45's B x N = 8, H = 64 and its second
TARGET_RATIO = 1.2
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEM_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([\d,]*)\]")


def hlo_arrays(text: str) -> set[tuple[str, tuple[int, ...]]]:
    """Every distinct (dtype, dims) array type written in an HLO module's text."""
    found = set()
    for dtype, dims in _SHAPE.findall(text):
        found.add((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return found


def array_bytes(array: tuple[str, tuple[int, ...]]) -> int:
    dtype, dims = array
    size = _ITEM_BYTES[dtype]
    for d in dims:
        size *= d
    return size


def quadratic_arrays(arrays: set, length: int) -> list[str]:
    """The arrays with at least two axes of ``length`` or more: (T, S) buffers, as text."""
    long_axes = lambda dims: sum(d >= length for d in dims)
    found = sorted((a for a in arrays if long_axes(a[1]) >= 2), key=array_bytes, reverse=True)
    return [f"{dtype}[{','.join(map(str, dims))}]" for dtype, dims in found]


def arm_row(scheme: str, length: int, shape: tuple[int, int, int]) -> dict[str, Any]:
    """One arm compiled deviceless for the H100: its memory plan and largest arrays."""
    from experiments.kernel_ptx import lowered_layer

    label = scheme if scheme == BASELINE else f"{scheme} kernel"
    row: dict[str, Any] = {"label": label, "scheme": scheme, "T": length, "shape": list(shape)}
    start = time.perf_counter()
    try:
        compiled = lowered_layer(scheme, length, shape, "bfloat16").compile()
    except Exception as error:  # an arm that fails costs its own row only
        return {**row, "status": "error", "error": f"{type(error).__name__}: {str(error)[:400]}"}
    analysis = compiled.memory_analysis()
    arrays = hlo_arrays(compiled.as_text())
    row.update(
        status="ok",
        compile_s=round(time.perf_counter() - start, 1),
        temp_bytes=int(analysis.temp_size_in_bytes),
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        largest_bytes=max(map(array_bytes, arrays), default=0),
        quadratic=quadratic_arrays(arrays, length),
    )
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each ok row's temp over its group's (shape, T) cuDNN nope temp, and the target met."""
    base = {
        (tuple(r["shape"]), r["T"]): r["temp_bytes"]
        for r in rows
        if r["scheme"] == BASELINE and r["status"] == "ok"
    }
    for row in rows:
        reference = base.get((tuple(row["shape"]), row["T"]))
        if row["status"] == "ok" and reference:
            row["ratio"] = row["temp_bytes"] / reference
            row["met"] = row["ratio"] <= TARGET_RATIO and not row["quadratic"]
    return rows


def merged_rows(kept: list[dict], measured: list[dict]) -> list[dict]:
    """``kept`` (an earlier run's rows) with each row of the same scheme, shape and T replaced
    by ``measured``'s, then ``measured``'s new rows: a run of a few schemes updates a full page
    (``--merge``) instead of replacing it; sorted by shape, T and the arms' order."""
    key = lambda r: (r["scheme"], tuple(r["shape"]), r["T"])
    fresh = {key(r): r for r in measured}
    rows = [fresh.pop(key(r), r) for r in kept] + [r for r in measured if key(r) in fresh]
    order = [BASELINE, *KERNEL_SCHEMES]
    rank = lambda s: order.index(s) if s in order else len(order)
    return sorted(rows, key=lambda r: (tuple(r["shape"]), r["T"], rank(r["scheme"])))


def page(rows: list[dict], meta: dict) -> str:
    """The markdown page of the rows (:func:`with_ratios`'d)."""
    mib = lambda b: f"{b / 2**20:,.0f}"
    lines = [
        "# XLA's temporary memory of the fused kernels on an H100, compiled without a GPU "
        "(issue 45)",
        "",
        f"Compiled {meta['date']} on this project's CPU machine for an H100 (sm_90a, "
        f"deviceless) with jax {meta['jax']}: {meta['command']}. One attention layer's "
        "forward + backward in bfloat16 (`experiments/bench_measure.py`'s layer). How it is "
        "measured, and a cross-check against the H100 run: `experiments/kernel_memory.py`'s "
        "docstring.",
        "",
        f"Target (issue 45): no (T, S) buffer, and XLA temporaries at most {TARGET_RATIO}x "
        "cuDNN nope's (`dpa`). temp = XLA's temporaries; largest = the largest array of the "
        "optimized HLO; (T, S) = arrays with two axes of at least T.",
        "",
        "| B | N | H | T | arm | temp MiB | ratio to dpa | largest MiB | (T, S) arrays | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, n, h = r["shape"]
        head = f"| {b} | {n} | {h} | {r['T']} | {r['label']} |"
        if r["status"] != "ok":
            lines.append(f"{head} error: {r['error'][:160]} | | | | |")
            continue
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else ""
        quadratic = ", ".join(r["quadratic"]) or "none"
        met = "" if "met" not in r or r["scheme"] == BASELINE else ("yes" if r["met"] else "no")
        lines.append(
            f"{head} {mib(r['temp_bytes'])} | {ratio} | {mib(r['largest_bytes'])} | "
            f"{quadratic} | {met} |"
        )
    judged = [r for r in rows if "met" in r and r["scheme"] != BASELINE]
    missed = sorted({r["scheme"] for r in judged if not r["met"]})
    met = sorted({r["scheme"] for r in judged} - set(missed))
    lines += [
        "",
        f"Within the target at every measured shape: {', '.join(met) or 'none'}. Not within "
        f"it: {', '.join(missed) or 'none'}. The kernels keep no (T, S) array; what passes "
        "1.2x is PaTH's state outside them: its levels of chunk pairs keep the rows each "
        "level reads, O(T H log(T / C)) (`copejax/model/path_levels.py`), beside the leaf "
        "chunks' (C, C) blocks, the float32 Householder vectors and UT transforms, and the "
        "chunks' (H, H) products (README's attention paths table lists each); until "
        "2026-11-28 it kept its queries per key chunk, O(T^2 H / C), which compiled here to "
        "2,711 and 27,193 MiB (21x and 13x) at these shapes. Stick-breaking's and "
        "CoPE's GPU kernels keep their carries per carry group of key tiles, O(T H) "
        "(`copejax/ops/kernels/carry_groups.py`); selective attention's GPU backward is one "
        "kernel over key tiles that sums the penalty prefix again as it walks and adds dq "
        "with atomics, O(T H) (`copejax/ops/kernels/selective_backward.py`); its forward's "
        "prefix per (query tile, key), living only through the forward, is at most the "
        "queries' bytes: past that the forward runs in calls of R query tiles, the prefix "
        "carried (`copejax/ops/kernels/selective_prefix.py`; at T = 65536, (2, 4, 64), "
        "in one call it compiled here to 771 MiB, 1.50x). Shaw's `relative` and "
        "`relative_capped` add their table's gradient with "
        "atomics into one (P, H) float32 array per batch row, O(T H) "
        "(`copejax/ops/kernels/relative.py`); until 2026-11-28 it was one slab per (batch "
        "row, head, query tile), O(T^2 H / 64) per head, which compiled here to 8,405 and "
        "133,644 MiB of temporaries (65x and 64x) at these shapes.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.kernel_memory")
    parser.add_argument("--lengths", default="16384", help="T values, comma-separated")
    parser.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--schemes", default=",".join(KERNEL_SCHEMES))
    parser.add_argument("--out_dir", default="experiments/results")
    parser.add_argument("--render", help="rewrite the page from this JSON and stop")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of out_dir's kernel_memory.json that this run does not measure",
    )
    args = parser.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        text = page(with_ratios(merged_rows(result["rows"], [])), result["meta"])
        (Path(args.out_dir) / "kernel_memory.md").write_text(text)
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host computes; the H100 is a target
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver, no CUPTI
    import jax

    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    lengths = [int(x) for x in args.lengths.split(",")]
    schemes = [BASELINE, *args.schemes.split(",")]
    command = "`.venv-ptx/bin/python -m experiments.kernel_memory` " + " ".join(
        f"--{k} {v}" for k, v in (("lengths", args.lengths), ("shapes", args.shapes))
    )
    meta = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "command": command}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = []
    if args.merge and (out / "kernel_memory.json").exists():
        earlier = json.loads((out / "kernel_memory.json").read_text())
        kept = earlier["rows"]
        run, joint = f"{command} --schemes {args.schemes}", "; then, merged, "
        runs = [c for c in earlier["meta"]["command"].split(joint) if c != run]
        meta["command"] = joint.join([*runs, run])  # a run repeated is listed once, last
        if earlier["meta"]["date"] != meta["date"]:  # the kept rows keep their own dates
            meta["date"] = f"{earlier['meta']['date'].split(' and ')[0]} and {meta['date']}"
    rows = []
    for shape in shapes:
        for length in lengths:
            for scheme in schemes:
                rows.append(arm_row(scheme, length, shape))
                r = rows[-1]
                print(r["label"], shape, length, r.get("temp_bytes", r.get("error")), flush=True)
                # the page after every arm: a stopped run keeps what it measured
                written = with_ratios(merged_rows(kept, rows))
                (out / "kernel_memory.json").write_text(
                    json.dumps({"meta": meta, "rows": written}, indent=1)
                )
                (out / "kernel_memory.md").write_text(page(written, meta))
    print(page(with_ratios(merged_rows(kept, rows)), meta))


if __name__ == "__main__":
    main()

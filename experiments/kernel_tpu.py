"""The TPU kernels as a TPU compiles them, from a CPU: does Mosaic take every kernel, on which
TPU generations, and what XLA's memory plan holds (issue 45).

    .venv-ptx/bin/python -m experiments.kernel_tpu --setup      # once: libtpu in .venv-ptx
    .venv-ptx/bin/python -m experiments.kernel_tpu               # both parts (~10 minutes)
    .venv-ptx/bin/python -m experiments.kernel_tpu --parts compile --generations v5e
    python -m experiments.kernel_tpu --render experiments/results/kernel_tpu.json

No session of this project has had a TPU. The tests run the TPU kernels in Pallas's TPU
interpret mode and export them for ``platforms=["tpu"]``, which runs Pallas's lowering to
Mosaic's MLIR (block shapes, primitives). Mosaic's own passes (vector layouts, relayouts,
shape casts) and XLA's TPU memory plan run only where a TPU compiles the program. libtpu
does that without a TPU: ``jax.experimental.topologies.get_topology_desc(topology_name=...,
platform="tpu")`` gives compile-only devices of a named TPU slice, and a program lowered for
them compiles in full, Mosaic included (a kernel Mosaic rejects raises ``MosaicError`` here,
as it would on the TPU). ``.venv-ptx`` (``experiments.kernel_ptx --setup``: Python 3.12,
the accelerator machine's jax 0.11.2) with ``LIBTPU``, the libtpu that ``jax[tpu]==0.11.2``
pins, does it; the kernels take the Mosaic path where ``jax.default_backend()`` says "tpu",
so it says so while tracing.

Two parts:

- **compile**: every scheme the kernels cover (the registry and
  ``kernel_terms.CHECKED_COMPOSITES``, refused ones skipped by ``kernel_refusal``), as a
  one-layer model on ``attention_impl="kernel"`` with grouped KV heads, a window with sink
  tokens where the scheme takes them, and several query and key tiles (``LENGTH`` tokens,
  query tiles of ``BLOCK``, key tiles of 128): its forward + backward compiled for each
  generation in bfloat16 and float32. A row is ok or the compiler's first error line.
  ``tests/ops/kernels/test_tpu_compile.py`` runs this part with the pinned jax.
- **memory**: ``experiments.bench_measure``'s layer (one attention layer, forward + backward,
  bfloat16) at T = 16384 and issue 45's two (B, N, H), per kernel scheme, on one generation:
  XLA's temporaries, their ratio to the nope kernel's (the TPU has no cuDNN; Pallas's splash
  attention is not an arm here), the largest array, and the (T, S) arrays
  (``experiments.kernel_memory``'s measures). A program over the device's HBM is the
  compiler's RESOURCE_EXHAUSTED, recorded as such.

These are compile-time facts. Speed on a TPU is not measured (issue 45: TPU speed claims
wait for a TPU). Writes ``kernel_tpu.md`` and ``kernel_tpu.json`` under ``--out_dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.kernel_memory import KERNEL_SCHEMES, array_bytes, hlo_arrays, quadratic_arrays

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-ptx" / "bin" / "python"
LIBTPU = "libtpu==0.0.48.1"  # what jax[tpu]==0.11.2 requires (libtpu==0.0.48.*)
# Compile-only slices: libtpu names a topology by generation and chips; one chip of each is
# the compile target (4 chips: the smallest host these names accept).
GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
LENGTH, BLOCK = 640, 64  # 10 query tiles, 5 key tiles of 128
HEADS, KV_HEADS, D_MODEL, WINDOW, SINKS = 4, 2, 128, 300, 2
MEMORY_SHAPES = ((2, 4, 64), (4, 16, 128))
MEMORY_LENGTH = 16384


def setup() -> None:
    """Installs LIBTPU into .venv-ptx (made by ``experiments.kernel_ptx --setup``)."""
    if not VENV_PYTHON.exists():
        raise SystemExit(f"no {VENV_PYTHON}: run python -m experiments.kernel_ptx --setup first")
    subprocess.run([str(VENV_PYTHON), "-m", "pip", "install", "--quiet", LIBTPU], check=True)
    print(f"ready: {VENV_PYTHON} -m experiments.kernel_tpu")


def tpu_device(generation: str) -> Any:
    """A compile-only chip of ``generation`` (a key of GENERATIONS)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(topology_name=GENERATIONS[generation], platform="tpu")
    return topology.devices[0]


def compile_for_tpu(fn: Any, args: Any, device: Any) -> Any:
    """``fn`` (jitted) traced on ``args``' shapes, lowered for ``device`` with the kernels'
    Mosaic path, and compiled."""
    import jax

    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    backend = jax.default_backend
    jax.default_backend = lambda: "tpu"  # the kernels' backend=None picks Mosaic TPU
    try:
        lowered = fn.trace(*specs).lower(lowering_platforms=("tpu",))
    finally:
        jax.default_backend = backend
    return lowered.compile()


def covered_schemes() -> list[str]:
    """The registry's schemes and ``kernel_terms.CHECKED_COMPOSITES`` that the kernels run
    (the TPU kernels run all of them)."""
    from copejax.model.kernel_terms import CHECKED_COMPOSITES, kernel_refusal
    from copejax.positions import registry

    names = [*registry.names(), *CHECKED_COMPOSITES]
    schemes = {name: registry.make_scheme(name) for name in names}
    return [name for name, scheme in schemes.items() if kernel_refusal(scheme) is None]


def model_program(scheme: str, dtype: str) -> tuple:
    """(jitted loss gradient, its abstract args) of a one-layer model of ``scheme`` on the
    kernels: grouped KV heads, packed segments' ids, a window with sinks where taken."""
    import jax
    import jax.numpy as jnp

    from copejax.model import checks
    from copejax.model.config import ModelConfig
    from copejax.model.transformer import Transformer
    from copejax.positions import registry

    spec = registry.make_scheme(scheme)
    cfg = checks.validate(
        ModelConfig(
            vocab_size=32,
            d_model=D_MODEL,
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            num_layers=2 if spec.share_across_layers else 1,
            max_len=LENGTH,
            position=scheme,
            attention_impl="kernel",
            attention_block=BLOCK,
            window=WINDOW,
            window_sink_tokens=SINKS if spec.window_sinks else 0,
            dtype=dtype,
        )
    )
    model = Transformer(cfg)
    ints = jax.ShapeDtypeStruct((2, LENGTH), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), ints, ints)["params"]

    def grad(p: Any, tokens_BT: jax.Array, positions_BT: jax.Array, ids_BT: jax.Array) -> Any:
        def loss(p: Any) -> jax.Array:
            logits_BTV = model.apply({"params": p}, tokens_BT, positions_BT, ids_BT)
            return jnp.mean(jnp.sin(logits_BTV.astype(jnp.float32)))

        return jax.grad(loss)(p)

    return jax.jit(grad), (params, ints, ints, ints)


def _error(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def compile_rows(generations: list[str], schemes: list[str], dtypes: list[str]) -> list[dict]:
    """The compile part: one row per (generation, scheme, dtype)."""
    rows = []
    for generation in generations:
        device = tpu_device(generation)
        for scheme in schemes:
            for dtype in dtypes:
                row = {"generation": generation, "scheme": scheme, "dtype": dtype}
                start = time.perf_counter()
                try:
                    compiled = compile_for_tpu(*model_program(scheme, dtype), device)
                    calls = compiled.as_text().count("tpu_custom_call")
                    row.update(status="ok" if calls else "no kernel", kernels=calls)
                except Exception as error:  # a scheme that fails costs its own row only
                    row.update(status="error", error=_error(error))
                row["compile_s"] = round(time.perf_counter() - start, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def memory_rows(generation: str, schemes: list[str], shapes: list[tuple]) -> list[dict]:
    """The memory part: one row per (shape, scheme) of the benchmark layer at MEMORY_LENGTH."""
    from experiments import bench_measure

    device, rows = tpu_device(generation), []
    for shape in shapes:
        for scheme in schemes:
            row: dict[str, Any] = {"generation": generation, "scheme": scheme}
            row.update(shape=list(shape), T=MEMORY_LENGTH)
            try:
                with bench_measure.layer_shape(*shape):
                    program = bench_measure._layer_program(
                        scheme,
                        MEMORY_LENGTH,
                        {"attention_impl": "kernel", "dtype": "bfloat16"},
                        abstract=True,
                    )
                compiled = compile_for_tpu(*program, device)
            except Exception as error:
                row.update(status="error", error=_error(error))
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            arrays = hlo_arrays(compiled.as_text())
            row.update(
                status="ok",
                temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
                largest_bytes=max(map(array_bytes, arrays), default=0),
                quadratic=quadratic_arrays(arrays, MEMORY_LENGTH),
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def page(result: dict) -> str:
    """The markdown page of a run's JSON."""
    lines = [
        "# The TPU kernels compiled for TPUs, without a TPU (issue 45)",
        "",
        f"Compiled {result['date']} on this project's CPU machine with jax {result['jax']} and "
        f"libtpu {result['libtpu']} for compile-only TPU chips: {result['command']}. How, and "
        "what it does not show (speed): `experiments/kernel_tpu.py`'s docstring.",
    ]
    if result["compile"]:
        lines += ["", *_compile_section(result)]
    if result["memory"]:
        lines += ["", *_memory_section(result["memory"])]
    return "\n".join(lines) + "\n"


def _compile_section(result: dict) -> list[str]:
    rows = result["compile"]
    columns = sorted({(r["generation"], r["dtype"]) for r in rows}, key=lambda c: (c[1], c[0]))
    cell = {(r["scheme"], r["generation"], r["dtype"]): r for r in rows}
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    failed = [r for r in rows if r["status"] != "ok"]
    lines = [
        "## Does Mosaic compile every kernel?",
        "",
        f'A one-layer model per scheme on `attention_impl="kernel"`, forward + backward: '
        f"{result['length']} tokens, query tiles of {result['block']} and key tiles of 128, "
        f"{HEADS} query heads on {KV_HEADS} key/value heads, a window of {WINDOW} with "
        f"{SINKS} sink tokens where the scheme takes them. ok: XLA compiled the program with "
        "its Mosaic kernels (the count of `tpu_custom_call`s is in the JSON).",
        "",
        "| scheme | " + " | ".join(f"{g} {d}" for g, d in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for scheme in schemes:
        marks = [
            cell[(scheme, g, d)]["status"] if (scheme, g, d) in cell else "" for g, d in columns
        ]
        lines.append(f"| {scheme} | " + " | ".join(marks) + " |")
    lines += [
        "",
        f"{len(rows) - len(failed)} of {len(rows)} compiled."
        + ("" if not failed else " Failures:"),
    ]
    for r in failed:
        lines.append(
            f"- {r['scheme']}, {r['generation']}, {r['dtype']}: {r.get('error', r['status'])}"
        )
    return lines


def _memory_section(rows: list[dict]) -> list[str]:
    mib = lambda b: f"{b / 2**20:,.0f}"
    base = {
        tuple(r["shape"]): r["temp_bytes"]
        for r in rows
        if r["scheme"] == "nope" and r["status"] == "ok"
    }
    lines = [
        f"## XLA's temporaries at T = {MEMORY_LENGTH} on {rows[0]['generation']}",
        "",
        "One attention layer's forward + backward in bfloat16 (`experiments/bench_measure.py`'s "
        "layer) on the kernels. temp = XLA's temporaries; ratio = over the nope kernel's; "
        "largest = the largest array of the optimized HLO; (T, S) = arrays with two axes of at "
        "least T.",
        "",
        "| B | N | H | scheme | temp MiB | ratio to nope kernel | largest MiB | (T, S) arrays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, n, h = r["shape"]
        head = f"| {b} | {n} | {h} | {r['scheme']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['error'][:200]} | | | |")
            continue
        reference = base.get(tuple(r["shape"]))
        ratio = f"{r['temp_bytes'] / reference:.2f}x" if reference else ""
        quadratic = ", ".join(r["quadratic"]) or "none"
        lines.append(
            f"{head} {mib(r['temp_bytes'])} | {ratio} | {mib(r['largest_bytes'])} | {quadratic} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.kernel_tpu")
    parser.add_argument("--setup", action="store_true", help="install libtpu and stop")
    parser.add_argument("--parts", default="compile,memory")
    parser.add_argument("--generations", default=",".join(GENERATIONS))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--schemes", default="", help="compile part: these (default: all)")
    parser.add_argument("--memory_generation", default="v5p")
    parser.add_argument("--out_dir", default="experiments/results")
    parser.add_argument("--render", help="rewrite the page from this JSON and stop")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    if args.setup:
        setup()
        return
    if args.render:
        result = json.loads(Path(args.render).read_text())
        (out / "kernel_tpu.md").write_text(page(result))
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    parts = args.parts.split(",")
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "libtpu": LIBTPU.split("==")[1],
        "command": "`"
        + " ".join([".venv-ptx/bin/python -m experiments.kernel_tpu", *(argv or sys.argv[1:])])
        + "`",
        "length": LENGTH,
        "block": BLOCK,
        "compile": [],
        "memory": [],
    }
    if "compile" in parts:
        schemes = args.schemes.split(",") if args.schemes else covered_schemes()
        generations = args.generations.split(",")
        result["compile"] = compile_rows(generations, schemes, args.dtypes.split(","))
    if "memory" in parts:
        result["memory"] = memory_rows(args.memory_generation, list(KERNEL_SCHEMES), MEMORY_SHAPES)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_tpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "kernel_tpu.md").write_text(page(result))
    print(f"wrote {out / 'kernel_tpu.md'}")


if __name__ == "__main__":
    main()

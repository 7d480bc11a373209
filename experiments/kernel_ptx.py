"""The fused kernels as an H100 would compile them, from a CPU: registers, spills, matrix
instructions and compile time per Triton kernel, without a GPU (issue 45).

    python -m experiments.kernel_ptx --setup    # once: .venv-ptx (Python 3.12, ~5 GB)
    .venv-ptx/bin/python -m experiments.kernel_ptx --scheme stickbreaking
    .venv-ptx/bin/python -m experiments.kernel_ptx --scheme cope --length 1024 --timeout 900

GPU time is scarce (most sessions have none), and the kernels' speed problems show before they
run: on the first H100 measurement (``experiments/results/bench_kernels_gpu.md``) the slow
kernels were the ones whose machine code spills registers and runs float32 matmuls as FMA
loops, and CoPE's, which spill most, did not finish compiling. This compiles each Triton
kernel of one attention layer's forward + backward (``experiments.bench_measure``'s layer,
``attention_impl="kernel"``, bfloat16, (B, N, H) = ``--shape``) the way the GPU machine's
jax 0.11.2 does (Pallas -> Triton -> XLA's Triton pipeline -> LLVM -> PTX), deviceless, then
runs ``ptxas -v`` for sm_90a, and prints per kernel: warps, XLA's compile seconds, registers
and spill bytes per thread, ``wgmma`` / ``mma.sync`` / float32 FMA counts and PTX size
(:mod:`experiments.kernel_ptx_report`). Each kernel's PTX and ptxas log land under ``--out``.
A fast kernel here has no spills, its matmuls as ``wgmma`` and few FMAs (nope's: 0 spills,
~100 FMAs); these are proxies for speed, which only a GPU measures.

How (jax 0.11.2, its CUDA 13 plugin): ``jax.experimental.topologies.get_topology_desc(
platform="cuda", target_config=...)`` gives a compile-only H100 from ``h100_target.txtpb``
(an H100 80GB's GpuTargetConfigProto, as XLA's ``specs/h100_sxm.txtpb`` lists one) when
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (no driver, no CUPTI). The kernels take the Triton path
only where ``jax.default_backend()`` says "gpu", so it says so while tracing. Each
``__gpu$xla.gpu.triton`` custom call (its module in ``mhlo.backend_config``) is cut into a
module of its own and compiled in a child process (``--timeout`` each), with XLA dumping the
PTX. Needs Python 3.12 (``--python``), jax[cuda13] 0.11.2 and the ptxas of
``nvidia-cuda-nvcc``, which ``--setup`` installs; it runs from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from experiments import device_wheels
from experiments.kernel_ptx_report import entry_ptx, ptx_counts, ptxas_resources, table

ROOT = Path(__file__).resolve().parents[1]
TARGET = Path(__file__).with_name("h100_target.txtpb")
VENV = ROOT / ".venv-ptx"
TRITON_CALL = "__gpu$xla.gpu.triton"
# What --setup installs: the GPU machine's jax and the flax that runs on it (see
# experiments.device_wheels), beside copejax's own needs for building a layer.
PACKAGES = (
    "jax[cuda13]==0.11.2",
    "flax==0.12.10",
    "optax==0.2.8",
    "ml-collections==1.1.0",
    "absl-py",
    "numpy>=2,<3",
)


# Not installed beside them: the tests of torch and transformers skip without them (and
# they are large), and ruff checks style, not jax.
NOT_FOR_TESTS = ("ruff", "torch", "transformers")


def suite_packages() -> tuple[str, ...]:
    """What .venv-ptx needs beside PACKAGES so that the test suite runs on the GPU machine's
    jax from this CPU (Pallas's interpret modes as the device's jax has them): copejax's and
    its tests' packages (pyproject.toml) but PACKAGES' and NOT_FOR_TESTS, and the runtime
    packages the device image lacks; ``device_wheels.pins`` takes their versions from
    constraints.txt."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    names = [_name(r) for r in [*wanted, *device_wheels.MISSING_ON_DEVICE]]
    skip = {_name(p) for p in PACKAGES} | set(NOT_FOR_TESTS)
    return tuple(n for i, n in enumerate(names) if n not in skip and n not in names[:i])


def _name(requirement: str) -> str:
    """A requirement's package name, as pip compares them."""
    return device_wheels.normal_name(re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0])


def setup(python: str) -> None:
    """Creates .venv-ptx with ``python`` (3.12 or later) and installs PACKAGES and the pinned
    :func:`suite_packages`."""
    subprocess.run([python, "-m", "venv", str(VENV)], check=True)
    pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, *PACKAGES, *device_wheels.pins(names=suite_packages())], check=True)
    print(f"ready: {VENV}/bin/python -m experiments.kernel_ptx --scheme nope")
    print(f"tests on jax 0.11.2: {VENV}/bin/python -m pytest -n 2 tests")


def h100() -> Any:
    """The compile-only H100 of ``h100_target.txtpb``."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=TARGET.read_text()
    )
    return topology.devices[0]


def ptxas() -> str:
    """The ptxas of the nvidia-cuda-nvcc wheel that jax[cuda13] installs."""
    import nvidia

    for root in nvidia.__path__:
        found = sorted(Path(root).glob("cu*/bin/ptxas"))
        if found:
            return str(found[-1])
    raise FileNotFoundError("no ptxas under the nvidia packages: pip install nvidia-cuda-nvcc")


def lowered_layer(
    scheme: str, length: int, shape: tuple[int, int, int], dtype: str, impl: str = "kernel"
) -> Any:
    """The layer's forward + backward lowered for the H100 on ``impl`` (the model's
    attention_impl; ``experiments.bench_measure``'s scheme "dpa" brings its own)."""
    import jax

    from copejax.ops.kernels.gpu_lowering import abstract_gpu
    from experiments import bench_measure

    with bench_measure.layer_shape(*shape):
        fn, args = bench_measure._layer_program(
            scheme, length, {"attention_impl": impl, "dtype": dtype}, abstract=True
        )
    sharding = jax.sharding.SingleDeviceSharding(h100())
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
    backend = jax.default_backend
    jax.default_backend = lambda: "gpu"  # the kernels' interpret=None: compiled, not interpreted
    try:
        with abstract_gpu():
            return fn.trace(*specs).lower(lowering_platforms=("cuda",))
    finally:
        jax.default_backend = backend


def triton_calls(module: Any) -> list[Any]:
    """Every Triton custom call of a lowered StableHLO module, in program order."""
    from jax._src.lib.mlir import ir

    found = []

    def visit(op: Any) -> None:
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    child = inner.operation
                    if child.name == "stablehlo.custom_call":
                        target = ir.StringAttr(child.attributes["call_target_name"]).value
                        if target == TRITON_CALL:
                            found.append(child)
                    visit(child)

    visit(module.operation)
    return found


def call_facts(op: Any) -> dict:
    """The kernel's name and launch parameters, from its backend config."""
    from jax._src.lib.mlir import ir

    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    return {
        "kernel": ir.StringAttr(config["name"]).value,
        "num_warps": ir.IntegerAttr(config["num_warps"]).value,
        "num_stages": ir.IntegerAttr(config["num_stages"]).value,
    }


def standalone(op: Any, name: str) -> bytes:
    """A module whose main is only this custom call, as MLIR bytecode."""
    import io

    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func

    with op.context, ir.Location.unknown():
        module = ir.Module.create()
        i32 = ir.IntegerType.get_signless(32)
        module.operation.attributes["sym_name"] = ir.StringAttr.get(f"triton_{name}")
        module.operation.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, 1)
        module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)
        with ir.InsertionPoint(module.body):
            kind = ir.FunctionType.get([v.type for v in op.operands], [r.type for r in op.results])
            main = func.FuncOp("main", kind)
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
            with ir.InsertionPoint(block):
                call = op.clone()
                for i, argument in enumerate(block.arguments):
                    call.operands[i] = argument
                func.ReturnOp(list(call.results))
        buffer = io.BytesIO()
        module.operation.write_bytecode(buffer)
        return buffer.getvalue()


def compile_child(module_path: Path, dump: Path) -> None:
    """In a child process: compiles the module for the H100, dumping its PTX; prints the
    seconds."""
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    device = h100()
    dumping = {"xla_dump_to": str(dump), "xla_gpu_dump_llvmir": True, "xla_dump_emitter_re": "ptx"}
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=1,
        device_assignment=np.array([[device]]),
        env_options_overrides=dumping,
    )
    with mlir.make_ir_context():
        module = ir.Module.parse(module_path.read_bytes())
        start = time.perf_counter()
        devices = xla_client.DeviceList((device,))
        device.client.compile(module, executable_devices=devices, compile_options=options)
    print(f"COMPILE_S {time.perf_counter() - start:.3f}", flush=True)


def measure(op: Any, out: Path, timeout_s: float) -> dict:
    """One kernel: compiled in a child, its PTX counted and run through ptxas."""
    row = call_facts(op)
    name = row["kernel"]
    kernel_dir = out / name
    kernel_dir.mkdir(parents=True, exist_ok=True)
    for old in kernel_dir.glob("*"):
        old.unlink()
    module_path = kernel_dir / "kernel.mlirbc"
    module_path.write_bytes(standalone(op, name))
    command = [sys.executable, "-m", "experiments.kernel_ptx", "--child", str(module_path)]
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {**row, "error": f"compilation stopped after {timeout_s:.0f} s"}
    found = re.search(r"COMPILE_S ([\d.]+)", done.stdout)
    if done.returncode or not found:
        return {**row, "error": (done.stderr or done.stdout)[-600:]}
    row["compile_s"] = float(found.group(1))
    ptx_files = sorted(kernel_dir.glob("*.ptx"))
    if ptx_files:
        ptx_path = kernel_dir / f"{name}.ptx"
        ptx = ptx_files[-1].read_text()
        ptx_path.write_text(ptx)
        row.update(ptx_counts(entry_ptx(ptx, name)))
        report = subprocess.run(
            [ptxas(), "-arch=sm_90a", "-O3", "-v", str(ptx_path), "-o", os.devnull],
            capture_output=True,
            text=True,
            check=False,
        )
        log = report.stdout + report.stderr
        (kernel_dir / "ptxas.txt").write_text(log)
        row.update(ptxas_resources(log, name))
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.kernel_ptx")
    parser.add_argument("--setup", action="store_true", help="create .venv-ptx and stop")
    parser.add_argument("--python", default="python3.12", help="with --setup: Python >= 3.12")
    parser.add_argument("--scheme", default="nope")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--shape", default="2,4,64", help="B,N,H")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--timeout", type=float, default=600.0, help="per kernel, seconds")
    parser.add_argument("--warps", type=int, help="Triton warps (default: the kernels')")
    parser.add_argument(
        "--approx_log1p", action="store_true", help="stick-breaking's log1p as lg2.approx"
    )
    parser.add_argument("--out", default="/tmp/kernel_ptx", help="PTX, ptxas logs, rows.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # compile_child's module
    args = parser.parse_args(argv)
    if args.setup:
        setup(args.python)
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host computes; the H100 is a target
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver, no CUPTI
    if args.child:
        compile_child(Path(args.child), Path(args.child).parent)
        return
    shape = tuple(int(x) for x in args.shape.split(","))
    out = Path(args.out) / f"{args.scheme}_{args.length}" / f"w{args.warps or 'default'}"
    start = time.perf_counter()
    from copejax.ops.kernels.triton_params import approx_log1p_for_tracing, warps_for_tracing

    with warps_for_tracing(args.warps), approx_log1p_for_tracing(args.approx_log1p or None):
        lowered = lowered_layer(args.scheme, args.length, shape, args.dtype)
    module = lowered.compiler_ir("stablehlo")
    print(
        f"# {args.scheme}, T = {args.length}, (B, N, H) = {shape}, {args.dtype}: lowered in "
        f"{time.perf_counter() - start:.1f} s; sm_90a, per thread",
        flush=True,
    )
    rows = [measure(op, out, args.timeout) for op in triton_calls(module)]
    print(table(rows))
    (out / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

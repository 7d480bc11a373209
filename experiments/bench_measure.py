"""What the benchmark measures, inside its worker subprocesses: one attention layer's
forward+backward (time, XLA's buffer bytes, peak RSS), one training step through the command
line, and side-by-side rounds of several paths in one process (``experiments.bench``).
"""

from __future__ import annotations

import contextlib
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from experiments.bench_settings import (
    BATCH,
    HEAD_DIM,
    HEADS,
    LONG_RUN_S,
    MEMORY_CAP_BYTES,
    MODEL_KEYS,
    ROOT,
    STEP_MODEL,
)

# side_by_side: one timing spans about this long, in at most MAX_CALLS back-to-back calls.
MIN_TIMING_S = 0.02
# Arm options that steer how the kernels are traced, not the model (side_by_side).
LEVER_KEYS = (
    "kernel_warps",
    "kernel_scan",
    "kernel_carry_groups",
    "kernel_full_tiles",
    "kernel_approx_log1p",
)
MAX_CALLS = 64


@contextlib.contextmanager
def layer_shape(batch: int, heads: int, head_dim: int) -> Iterator[None]:
    """Builds the layer at another (B, N, H) inside the context: the module's BATCH, HEADS
    and HEAD_DIM, which the layer reads when it is built."""
    global BATCH, HEADS, HEAD_DIM
    saved = (BATCH, HEADS, HEAD_DIM)
    BATCH, HEADS, HEAD_DIM = batch, heads, head_dim
    try:
        yield
    finally:
        BATCH, HEADS, HEAD_DIM = saved


def _position_fields(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a benchmarked name: ``dpa`` is ``nope`` on the
    ``jax.nn.dot_product_attention`` kernel (the same layer, projections and mask); the
    ``MODEL_KEYS`` of ``options`` are model-level options (attention path, dtype)."""
    model = {k: v for k, v in options.items() if k in MODEL_KEYS}
    if scheme == "dpa":  # the arm's other model options (its dtype) still apply
        return {**model, "position": "nope", "attention_impl": "dot_product_attention"}
    own = {k: v for k, v in options.items() if k not in MODEL_KEYS}
    return {"position": scheme, "position_options": own, **model}


def layer_config(scheme: str, length: int, options: dict[str, Any]) -> Any:
    """The ModelConfig of the benchmarked layer."""
    from copejax.model import checks
    from copejax.model.config import ModelConfig

    return checks.validate(
        ModelConfig(
            vocab_size=16,
            d_model=HEADS * HEAD_DIM,
            num_heads=HEADS,
            num_layers=1,
            head_dim=HEAD_DIM,
            max_len=length,
            **_position_fields(scheme, options),
        )
    )


def _path_taken(scheme: str, length: int, options: dict[str, Any]) -> str:
    """The attention path the layer takes at ``length`` (what ``auto`` resolves to)."""
    import jax

    from copejax.model.attention_paths import choose_impl

    cfg = layer_config(scheme, length, options)
    pairs = BATCH * HEADS * length * length  # what the layer passes: B N T S
    return choose_impl(cfg, length, sowing=False, backend=jax.default_backend(), pairs=pairs)


def _layer_program(
    scheme: str,
    length: int,
    options: dict[str, Any],
    abstract: bool = False,
    compile_init: bool = False,
) -> tuple:
    """(jitted fwd+bwd fn, its args) for one attention layer of ``scheme`` at ``length``;
    ``abstract``: the args as shapes only, the parameters' init traced, not run (for a
    compile without running: the kernels' init on a CPU runs Pallas's interpreter, which at
    (B, N, H) = (4, 16, 128), T = 16384 took over 24 GB of host memory), and with
    ``compile_init`` the jitted init compiled (into the persistent cache, where one is set)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from copejax.model.attention import Attention
    from copejax.positions.base import AttentionContext, EmbedOutput

    d_model = HEADS * HEAD_DIM
    key_x, key_p, key_c = jax.random.split(jax.random.key(0), 3)
    x_BTD = jax.random.normal(key_x, (BATCH, length, d_model), jnp.float32)
    cot_BTD = jax.random.normal(key_c, (BATCH, length, d_model), jnp.float32)
    positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (BATCH, length))

    cfg = layer_config(scheme, length, options)
    scheme_spec = cfg.scheme

    class Layer(nn.Module):
        def setup(self) -> None:
            self.embed = scheme_spec.embed_module(cfg.dims)
            self.shared = scheme_spec.shared_attention_module(cfg.dims)
            self.attention = Attention(cfg, shared=self.shared)

        def __call__(self, x_BTD: jax.Array) -> jax.Array:
            emb = EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT)
            if self.embed is not None:
                emb = self.embed(x_BTD, positions_BT, True)
            ctx = AttentionContext.create(emb.x_BTD, emb.positions_BT, carry=emb.carry)
            return self.attention(emb.x_BTD, ctx)[0]

    module = Layer()
    # jitted: one program, which bench_kernels_warm's workers compile into the persistent
    # cache ahead of the timed process (eager, every op compiled on its own: a Triton compile
    # per kernel call on a GPU)
    init = jax.jit(module.init)
    if abstract:
        x_BTD, cot_BTD = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (x_BTD, cot_BTD))
        params = jax.eval_shape(module.init, key_p, x_BTD)
        if compile_init:
            init.lower(key_p, x_BTD).compile()
    else:
        params = init(key_p, x_BTD)

    # the cotangent an argument, not a constant of the program: a (B, T, D) constant is
    # folded by XLA's compiler (minutes at B = 4, T = 16384, D = 2048 for a deviceless
    # compile, experiments/kernel_memory.py)
    def fwd_bwd(params: Any, x_BTD: jax.Array, cot_BTD: jax.Array) -> Any:
        def loss(p: Any, x: jax.Array) -> jax.Array:
            return jnp.sum(module.apply(p, x) * cot_BTD)

        return jax.grad(loss, argnums=(0, 1))(params, x_BTD)

    return jax.jit(fwd_bwd), (params, x_BTD, cot_BTD)


def lm_command(config_arg: str, workdir: str) -> list[str]:
    """``python -m copejax.main`` on ``configs/lm.py:config_arg``, writing under ``workdir``
    (the command line's flags follow)."""
    command = [sys.executable, "-m", "copejax.main", f"--config=configs/lm.py:{config_arg}"]
    return [*command, f"--workdir={workdir}/run"]


def cli_step(scheme: str, length: int) -> dict:
    """One training step of the bench's small model (STEP_MODEL) at ``length`` through the
    command line (``python -m copejax.main``, configs/lm.py, batch 1, one eval example): its
    wall time and the peak RSS of that process (this worker's only child)."""
    import tempfile

    m = STEP_MODEL
    arg = (
        f"cpu,position={scheme},length={length},steps=1,batch_size=1,d_model={m['d_model']},"
        f"heads={m['num_heads']},layers={m['num_layers']}"
    )
    row: dict[str, Any] = {"kind": "cli_step", "scheme": scheme, "T": length}
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            *lm_command(arg, workdir),
            "--config.eval.batch_size=1",
            "--config.eval.max_examples=1",
            "--config.train.warmup_steps=0",
        ]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        row["time_s"] = time.perf_counter() - start
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    row["command"] = "python -m copejax.main " + " ".join(command[3:4]) + " (batch 1)"
    row["status"] = "ok" if done.returncode == 0 else "error"
    if done.returncode != 0:
        row["stderr_tail"] = done.stderr[-800:]
    return row


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def measure(kind: str, scheme: str, length: int, repeats: int, options: dict[str, Any]) -> dict:
    """One measurement (run inside a worker subprocess): compile, predict memory, time."""
    import jax

    fn, args = _layer_program(scheme, length, options)
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_s = time.perf_counter() - start
    row: dict[str, Any] = {"kind": kind, "scheme": scheme, "T": length, "compile_s": compile_s}
    analysis = compiled.memory_analysis()
    if analysis is not None:
        row["xla_bytes"] = int(
            analysis.temp_size_in_bytes
            + analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
        )
        row["xla_temp_bytes"] = int(analysis.temp_size_in_bytes)
    if row.get("xla_bytes", 0) > MEMORY_CAP_BYTES:
        row["status"] = "over_memory_cap"
        return row
    row["rss_before_run_bytes"] = _rss_bytes()
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))  # warm-up (compilation is already done)
    times = [time.perf_counter() - start]
    if times[0] < LONG_RUN_S:  # long runs are timed once: the warm-up is the measurement
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - start)
    row["timed_runs"] = len(times)
    row.update(status="ok", time_s=statistics.median(times), peak_rss_bytes=_rss_bytes())
    return row


@contextlib.contextmanager
def arm_levers(arm_options: dict[str, Any]) -> Iterator[None]:
    """An arm's benchmark levers (``LEVER_KEYS``; absent: the default), set while its
    program is traced: "kernel_warps", the Triton kernels' warps; "kernel_scan", their
    within-tile sums as prefix sums or tensor-core matmuls; "kernel_carry_groups",
    stick-breaking's and CoPE's carry checkpoints per head; "kernel_full_tiles", the softmax
    kernels' mask-free body on full pairs; "kernel_approx_log1p", stick-breaking's log1p as
    lg2.approx."""
    from copejax.ops.kernels.carry_groups import carry_groups_for_tracing
    from copejax.ops.kernels.padding import full_tiles_for_tracing
    from copejax.ops.kernels.triton_params import (
        approx_log1p_for_tracing,
        scan_for_tracing,
        warps_for_tracing,
    )

    with (
        warps_for_tracing(arm_options.get("kernel_warps")),
        scan_for_tracing(arm_options.get("kernel_scan")),
        carry_groups_for_tracing(arm_options.get("kernel_carry_groups")),
        full_tiles_for_tracing(arm_options.get("kernel_full_tiles")),
        approx_log1p_for_tracing(arm_options.get("kernel_approx_log1p")),
    ):
        yield


def compile_arm(scheme: str, length: int, arm_options: dict[str, Any]) -> None:
    """Compiles, without running, the two programs :func:`side_by_side` runs for this arm
    (the layer's jitted init and its forward + backward under the arm's levers), so that a
    persistent compilation cache holds them for the process that times it
    (``experiments.bench_kernels_warm``)."""
    options = {k: v for k, v in arm_options.items() if k not in LEVER_KEYS}
    fn, args = _layer_program(scheme, length, options, abstract=True, compile_init=True)
    with arm_levers(arm_options):
        fn.lower(*args).compile()


def side_by_side(length: int, arms: list, rounds: int) -> list[dict]:
    """Times every arm at ``length`` in this process, interleaved (see SIDE_BY_SIDE_ARMS).

    An arm that fails to compile or run is a row with ``status="error"`` and its message,
    and the other arms still run. A timing is ``calls`` back-to-back calls over one
    ``block_until_ready``, divided by ``calls``: enough calls (from a timed single call after
    the warm-up) that one timing spans about ``MIN_TIMING_S``, so that the host's dispatch of
    a call (tens of microseconds) does not pad a kernel of a fraction of a millisecond.
    """
    import jax

    compiled, rows = {}, []
    for label, scheme, arm_options in arms:
        options = {k: v for k, v in arm_options.items() if k not in LEVER_KEYS}
        try:
            fn, args = _layer_program(scheme, length, options)
            with arm_levers(arm_options):
                program = fn.lower(*args).compile()
            analysis = program.memory_analysis()
            xla = 0 if analysis is None else int(analysis.temp_size_in_bytes)
            if xla > MEMORY_CAP_BYTES:
                rows.append({"label": label, "status": "over_memory_cap", "xla_temp_bytes": xla})
                continue
            jax.block_until_ready(program(*args))  # warm-up
            start = time.perf_counter()
            jax.block_until_ready(program(*args))
            single_s = time.perf_counter() - start
        except Exception as error:  # a path that fails here costs its own arm only
            message = f"{type(error).__name__}: {str(error)[:600]}"
            rows.append({"label": label, "status": "error", "error": message})
            continue
        calls = max(1, min(MAX_CALLS, math.ceil(MIN_TIMING_S / max(single_s, 1e-6))))
        compiled[label] = (program, args, calls)
        path = _path_taken(scheme, length, options)
        rows.append(
            {
                "label": label,
                "status": "ok",
                "xla_temp_bytes": xla,
                "times_s": [],
                "calls": calls,
                "path": path,
            }
        )
    by_label = {row["label"]: row for row in rows if row["status"] == "ok"}
    order = list(by_label)
    for round_index in range(rounds):
        shift = round_index % len(order)
        for label in order[shift:] + order[:shift]:
            program, args, calls = compiled[label]
            start = time.perf_counter()
            for _ in range(calls):
                out = program(*args)
            jax.block_until_ready(out)
            by_label[label]["times_s"].append((time.perf_counter() - start) / calls)
    out = []
    for row in rows:
        times = row.get("times_s", [])
        out.append(
            {
                "kind": "side_by_side",
                "scheme": row["label"],
                "T": length,
                **row,
                **({"time_s": statistics.median(times)} if times else {}),
            }
        )
    return out

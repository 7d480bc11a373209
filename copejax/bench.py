"""Benchmark of every position scheme: time and memory of attention against length (a script).

Issue 8's benchmark for CoPE (Golovneva et al. 2024, arXiv 2405.18719) and the other schemes:
forward+backward time and peak memory of one attention layer (the scheme's embed site, then
one ``copejax.attention.Attention`` with projections) and of one full training step of a small
model (AdamW), over T = 256, 512, ... as far as memory and a time cap allow, with fixed
B x N and head dim. ``dpa`` is the same layer without a scheme on ``jax.nn.dot_product_attention``;
ratios are to ``nope``, measured in the same run. Measurements run in subprocesses (an
out-of-memory death does not stop the script): one per measurement for ``nope``, ``dpa`` and
``cope`` (the targets), one per length series (ascending) for the other schemes. A scheme stops
at its first failure, time over the cap, or predicted memory over the cap (XLA's buffer
assignment, read before running). Also runs ``copejax.ops.bench_scan``.

    .venv/bin/python -m copejax.bench --mode full     # writes experiments/results/bench.*
    .venv/bin/python -m copejax.bench --mode quick --out_dir /tmp/bench   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = {
    # Lengths of the layer and step benchmarks for the target schemes (one subprocess per
    # measurement) and for the others (one subprocess per series, lengths ascending: a
    # 2-core machine cannot afford a process start and compile per point for every scheme),
    # timed repeats, and the time cap (s) per measurement.
    "quick": {
        "layer": [64],
        "step": [32],
        "other_layer": [64],
        "other_step": [32],
        "side_by_side": [64],
        "rounds": 2,
        "repeats": 1,
        "cap_s": 120,
    },
    "full": {
        "layer": [256, 512, 1024, 2048, 4096, 8192, 16384],
        "step": [256, 1024, 4096],
        "other_layer": [256, 1024, 4096, 16384],
        "other_step": [256, 1024],
        "side_by_side": [256, 512, 1024, 2048],
        "rounds": 7,
        "repeats": 2,
        "cap_s": 300,
    },
}
# The side-by-side timing: every arm compiled in one process, then ``rounds`` rounds that each
# time every arm once, in an order that rotates between rounds, so that a change of machine
# load hits all arms alike; ratios are taken within a round. (label, scheme, options.)
SIDE_BY_SIDE_ARMS = (
    ("nope", "nope", {}),
    ("nope naive", "nope", {"attention_impl": "naive"}),
    ("nope blockwise", "nope", {"attention_impl": "blockwise"}),
    ("dpa", "dpa", {}),
    ("cope", "cope", {}),
    ("cope naive", "cope", {"attention_impl": "naive"}),
    ("cope blockwise", "cope", {"attention_impl": "blockwise"}),
    ("fox", "fox", {}),
    ("fox naive", "fox", {"attention_impl": "naive"}),
    ("fox blockwise", "fox", {"attention_impl": "blockwise"}),
    ("stickbreaking", "stickbreaking", {}),
    ("stickbreaking naive", "stickbreaking", {"attention_impl": "naive"}),
    ("stickbreaking blockwise", "stickbreaking", {"attention_impl": "blockwise"}),
    ("alibi", "alibi", {}),
    ("alibi blockwise", "alibi", {"attention_impl": "blockwise"}),
)
# Keys of an arm's options that are model options, not the scheme's.
MODEL_KEYS = ("attention_impl", "attention_block", "attention_backward", "scan_impl")
TARGET_SCHEMES = ("nope", "dpa", "cope")
QUICK_SCHEMES = ("nope", "cope")
BATCH, HEADS, HEAD_DIM = 2, 4, 64  # B x N = 8, H = 64
STEP_MODEL = {"d_model": 256, "num_heads": 4, "num_layers": 2, "vocab_size": 256}
LONG_RUN_S = 5.0
MEMORY_CAP_BYTES = 10 * 2**30  # the machine is shared: never start a run predicted above this


def _position_fields(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a benchmarked name: ``dpa`` is ``nope`` on the
    ``jax.nn.dot_product_attention`` kernel (the same layer, projections and mask); the
    ``MODEL_KEYS`` of ``options`` are model-level attention options."""
    if scheme == "dpa":
        return {"position": "nope", "attention_impl": "dot_product_attention"}
    model = {k: v for k, v in options.items() if k in MODEL_KEYS}
    own = {k: v for k, v in options.items() if k not in MODEL_KEYS}
    return {"position": scheme, "position_options": own, **model}


def _layer_program(scheme: str, length: int, options: dict[str, Any]) -> tuple:
    """(jitted fwd+bwd fn, its args) for one attention layer of ``scheme`` at ``length``."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from copejax.attention import Attention
    from copejax.model_config import ModelConfig
    from copejax.positions.base import AttentionContext, EmbedOutput

    d_model = HEADS * HEAD_DIM
    key_x, key_p, key_c = jax.random.split(jax.random.key(0), 3)
    x_BTD = jax.random.normal(key_x, (BATCH, length, d_model), jnp.float32)
    cot_BTD = jax.random.normal(key_c, (BATCH, length, d_model), jnp.float32)
    positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (BATCH, length))

    cfg = ModelConfig(
        vocab_size=16,
        d_model=d_model,
        num_heads=HEADS,
        num_layers=1,
        head_dim=HEAD_DIM,
        max_len=length,
        **_position_fields(scheme, options),
    ).validate()
    scheme_spec = cfg.scheme()

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
    params = module.init(key_p, x_BTD)

    def fwd_bwd(params: Any, x_BTD: jax.Array) -> Any:
        def loss(p: Any, x: jax.Array) -> jax.Array:
            return jnp.sum(module.apply(p, x) * cot_BTD)

        return jax.grad(loss, argnums=(0, 1))(params, x_BTD)

    return jax.jit(fwd_bwd), (params, x_BTD)


def _step_program(scheme: str, length: int, options: dict[str, Any]) -> tuple:
    """(jitted AdamW training step, its args) of a small model at ``length``."""
    import jax
    import jax.numpy as jnp
    import optax

    from copejax.model import Transformer
    from copejax.model_config import ModelConfig

    cfg = ModelConfig(
        **STEP_MODEL,
        head_dim=HEAD_DIM,
        max_len=length,
        **_position_fields(scheme, options),
    ).validate()
    model = Transformer(cfg)
    tokens_BT = jax.random.randint(jax.random.key(1), (BATCH, length + 1), 0, cfg.vocab_size)
    positions_BT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (BATCH, length))
    params = model.init(jax.random.key(0), tokens_BT[:, :-1], positions_BT)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(params)

    def step(params: Any, opt_state: Any, tokens_BT: jax.Array) -> tuple:
        def loss_fn(p: Any) -> jax.Array:
            logits_BTV = model.apply(p, tokens_BT[:, :-1], positions_BT)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits_BTV, tokens_BT[:, 1:]
            ).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step), (params, opt_state, tokens_BT)


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def measure(kind: str, scheme: str, length: int, repeats: int, options: dict[str, Any]) -> dict:
    """One measurement (run inside a worker subprocess): compile, predict memory, time."""
    import jax

    build = _layer_program if kind == "layer" else _step_program
    fn, args = build(scheme, length, options)
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


def side_by_side(length: int, arms: list, rounds: int) -> list[dict]:
    """Times every arm at ``length`` in this process, interleaved (see SIDE_BY_SIDE_ARMS)."""
    import jax

    compiled, rows = {}, []
    for label, scheme, options in arms:
        fn, args = _layer_program(scheme, length, options)
        program = fn.lower(*args).compile()
        analysis = program.memory_analysis()
        xla = 0 if analysis is None else int(analysis.temp_size_in_bytes)
        if xla > MEMORY_CAP_BYTES:
            rows.append({"label": label, "status": "over_memory_cap", "xla_temp_bytes": xla})
            continue
        jax.block_until_ready(program(*args))  # warm-up
        compiled[label] = (program, args)
        rows.append({"label": label, "status": "ok", "xla_temp_bytes": xla, "times_s": []})
    by_label = {row["label"]: row for row in rows if row["status"] == "ok"}
    order = list(by_label)
    for round_index in range(rounds):
        shift = round_index % len(order)
        for label in order[shift:] + order[:shift]:
            program, args = compiled[label]
            start = time.perf_counter()
            jax.block_until_ready(program(*args))
            by_label[label]["times_s"].append(time.perf_counter() - start)
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


def _worker(spec: dict) -> None:
    """Measures spec["lengths"] in ascending order, one BENCH_ROW line each; stops after a
    run over the time cap or over the memory cap (peak RSS is then per length because memory
    grows with T)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if spec["kind"] == "side_by_side":
        for row in side_by_side(spec["lengths"][0], spec["arms"], spec["rounds"]):
            print("BENCH_ROW " + json.dumps(row), flush=True)
        return
    for length in spec["lengths"]:
        start = time.perf_counter()
        row = measure(spec["kind"], spec["scheme"], length, spec["repeats"], spec["options"])
        row["isolated"] = len(spec["lengths"]) == 1
        if row["status"] == "ok" and time.perf_counter() - start > spec["cap_s"]:
            row["status"] = f"over_time_cap_{spec['cap_s']:.0f}s"
        print("BENCH_ROW " + json.dumps(row), flush=True)
        if row["status"] != "ok":
            return


def _run_series(spec: dict) -> list[dict]:
    """Runs spec's lengths in one subprocess; a death or a timeout becomes a failed row for
    the first length without a result."""
    command = [sys.executable, "-m", "copejax.bench", "--worker", json.dumps(spec)]
    timeout = spec["cap_s"] * len(spec["lengths"])
    rows: list[dict] = []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
        failure = "error"
        if returncode < 0 or "RESOURCE_EXHAUSTED" in stderr or "MemoryError" in stderr:
            failure = "out_of_memory"
    except subprocess.TimeoutExpired as timed_out:
        stdout = timed_out.stdout.decode() if isinstance(timed_out.stdout, bytes) else ""
        stderr, returncode, failure = "", None, f"over_time_cap_{spec['cap_s']:.0f}s"
    for line in (stdout or "").splitlines():
        if line.startswith("BENCH_ROW "):
            rows.append(json.loads(line[len("BENCH_ROW ") :]))
    if spec["kind"] == "side_by_side":
        if not rows:
            rows.append({"kind": "side_by_side", "scheme": "all", "T": spec["lengths"][0],
                         "status": failure, "stderr_tail": (stderr or "")[-800:]})  # fmt: skip
        return rows
    if (not rows or rows[-1]["status"] == "ok") and len(rows) < len(spec["lengths"]):
        rows.append(
            {
                "kind": spec["kind"],
                "scheme": spec["scheme"],
                "T": spec["lengths"][len(rows)],
                "status": failure,
                "returncode": returncode,
                "stderr_tail": (stderr or "")[-800:],
            }
        )
    return rows


def scheme_options(scheme: str) -> dict[str, Any]:
    """Options of the benchmarked configuration: CoPE, FoX and stick-breaking blockwise from
    1024 tokens on (their "auto" default) and naive below."""
    return {}


def run_benchmark(mode: str, schemes: list[str] | None = None) -> dict:
    from copejax.positions import registry

    settings = MODES[mode]
    load_at_start = os.getloadavg()
    if schemes is None:
        first = ["nope", "dpa", "cope", "fox", "stickbreaking"]  # the targets' schemes first
        others = [name for name in registry.names() if name not in first]
        schemes = list(QUICK_SCHEMES) if mode == "quick" else first + others
    rows = []

    def run(spec: dict) -> list[dict]:
        series = _run_series({"repeats": settings["repeats"], "cap_s": settings["cap_s"], **spec})
        for row in series:
            print(_row_line(row), flush=True)
        return series

    for kind in ("layer", "step"):
        for scheme in schemes:
            base = {"kind": kind, "scheme": scheme, "options": scheme_options(scheme)}
            if scheme not in TARGET_SCHEMES:
                rows += run({**base, "lengths": settings[f"other_{kind}"]})
                continue
            for length in settings[kind]:  # one subprocess per measurement
                rows += run({**base, "lengths": [length]})
                if rows[-1]["status"] != "ok":
                    break
    if "cope" in schemes:  # interleaved timing, one process per length
        arms = [arm for arm in SIDE_BY_SIDE_ARMS if arm[1] in schemes]
        for length in settings["side_by_side"]:
            spec = {"kind": "side_by_side", "scheme": "all", "lengths": [length], "arms": arms}
            rows += run({**spec, "rounds": settings["rounds"], "cap_s": 4 * settings["cap_s"]})
    if mode == "full" and "cope" in schemes:  # the 32K target, one run
        spec = {"kind": "layer", "scheme": "cope", "options": {}, "lengths": [32768]}
        rows += [{**row, "extra": "target_32k"} for row in run({**spec, "cap_s": 900})]
    return {"meta": {**_meta(mode), "load_average_start": load_at_start}, "rows": rows}


def _row_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['kind']:5} {row['scheme']:16} T={row['T']:6} {row['status']}"
    return (
        f"{row['kind']:5} {row['scheme']:16} T={row['T']:6} {1e3 * row['time_s']:10.1f} ms "
        f"xla {row.get('xla_bytes', row.get('xla_temp_bytes', 0)) / 2**20:9.1f} MiB  "
        f"rss {row.get('peak_rss_bytes', 0) / 2**20:8.1f} MiB"
    )


def _meta(mode: str) -> dict:
    import jax

    return {
        "mode": mode,
        "command": f"python -m copejax.bench --mode {mode}",
        "batch": BATCH,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "step_model": STEP_MODEL,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_start": os.getloadavg(),
        "memory_cap_bytes": MEMORY_CAP_BYTES,
        "time_cap_s": MODES[mode]["cap_s"],
        "pallas": "not measured: no GPU in this session",
    }


def loglog_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) against log(x); None with fewer than two points."""
    points = [(x, y) for x, y in points if x > 0 and y > 0]
    if len(points) < 2:
        return None
    xs = [math.log(x) for x, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def _ok(rows: list[dict], kind: str, scheme: str) -> dict[int, dict]:
    return {
        r["T"]: r
        for r in rows
        if r["kind"] == kind and r["scheme"] == scheme and r["status"] == "ok"
    }


NOTES = [
    "Notes:",
    "",
    "- every scheme runs with the default `model.attention_impl='auto'`: the naive "
    "(B, N, T, S) path below `copejax.attention.AUTO_BLOCKWISE_PAIRS` and the blockwise "
    "engine (`copejax.ops.engine`) from it on; the 'Side by "
    "side' table times both paths. Their values and gradients are equal "
    "(tests/test_blockwise_equivalence.py).",
    "- CoPE's skip of saturated key blocks (`lax.cond`, every query already at p_max - 1) is "
    "on in all runs here.",
    "- Times of the per-scheme tables come from separate processes run one after another, so "
    "a change of machine load between them shows up in their ratios; the side-by-side rounds "
    "do not have that problem and are the ones the speed target reads.",
    "- `dpa` is the same layer (projections, mask) with `model.attention_impl = "
    "'dot_product_attention'`: `jax.nn.dot_product_attention` (XLA's implementation on CPU) "
    "instead of the explicit einsum path; its training-step rows are the nope model on that "
    "kernel. On CPU XLA's dot_product_attention is slower than copejax's einsum path, so the "
    "speed target is stated against both.",
    "- Where blockwise CoPE's time goes beyond FoX's (the same walk and online softmax): the "
    "gates, suffix sums and the two gathers of the interpolation (a scatter-add in the "
    "backward) in the key blocks before every query of a block has counted p_max - 1 gates "
    "(at random initialisation, gates near 0.5, about two blocks of 128 per query block); "
    "older blocks take the saturated branch.",
]


def round_ratios(rows: list[dict], label: str, length: int, base: str = "nope") -> list[float]:
    """Per-round time ratios label / base of the side-by-side rows at ``length``."""
    side = _ok(rows, "side_by_side", label).get(length)
    base = _ok(rows, "side_by_side", base).get(length)
    if side is None or base is None:
        return []
    return [a / b for a, b in zip(side["times_s"], base["times_s"], strict=True)]


def _ratio_cell(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def targets(result: dict) -> list[str]:
    """Issue 8's three targets, each stated as met / not met with the measured numbers."""
    rows = result["rows"]
    cope = _ok([r for r in rows if "extra" not in r], "layer", "cope")
    nope = _ok(rows, "layer", "nope")
    out = []
    side_ok = _ok(rows, "side_by_side", "cope")
    if 1024 in side_ok:
        # The baseline is nope on jax.nn.dot_product_attention (`dpa`); copejax's own
        # einsum nope is faster than XLA's dpa on CPU, so the ratio to it is stated as well.
        for base, name in (("dpa", "nope on jax.nn.dot_product_attention (`dpa`, the issue's "
                           "baseline)"), ("nope", "copejax's einsum nope (stricter)")):  # fmt: skip
            ratios = round_ratios(rows, "cope", 1024, base)
            if not ratios:
                out.append(f"- CoPE / {base} at T = 1024: not measured.")
                continue
            ratio = statistics.median(ratios)
            verdict = "met" if ratio <= 1.5 else "NOT met"
            base_row = _ok(rows, "side_by_side", base)[1024]
            out.append(
                f"- CoPE forward+backward at T = 1024 at most 1.5x {name}: {verdict}, median "
                f"ratio {ratio:.2f}x over {len(ratios)} interleaved rounds (range "
                f"{min(ratios):.2f}-{max(ratios):.2f}; medians {1e3 * side_ok[1024]['time_s']:.0f}"
                f" ms against {1e3 * base_row['time_s']:.0f} ms; see 'Side by side')."
            )
    elif 1024 in cope and 1024 in nope:
        ratio = cope[1024]["time_s"] / nope[1024]["time_s"]
        verdict = "met" if ratio <= 1.5 else "NOT met"
        out.append(
            f"- CoPE forward+backward at T = 1024 at most 1.5x nope: {verdict}, "
            f"{1e3 * cope[1024]['time_s']:.0f} ms against {1e3 * nope[1024]['time_s']:.0f} ms "
            f"({ratio:.2f}x)."
        )
    else:
        out.append("- CoPE / nope at T = 1024: not measured (a run failed).")
    span = [t for t in sorted(cope) if 2048 <= t <= 16384]
    for key, name in (("xla_bytes", "XLA buffers"), ("peak_rss_bytes", "peak RSS")):
        slope = loglog_slope([(t, cope[t][key]) for t in span])
        if slope is None:
            out.append(f"- CoPE memory slope ({name}): not measured.")
            continue
        verdict = "met" if slope <= 1.1 else "NOT met"
        out.append(
            f"- CoPE memory linear in T, log-log slope at most 1.1 from 2K to 16K ({name}, "
            f"T = {span[0]}..{span[-1]}): {verdict}, slope {slope:.2f}."
        )
    big = [r for r in rows if r.get("extra") == "target_32k"]
    if big and big[0]["status"] == "ok":
        peak = big[0]["peak_rss_bytes"] / 2**30
        verdict = "met" if peak <= 24 else "NOT met"
        out.append(
            f"- CoPE forward+backward at T = 32768, B x N = {BATCH * HEADS}, H = {HEAD_DIM} "
            f"within 24 GiB: {verdict}, peak RSS {peak:.2f} GiB (XLA buffers "
            f"{big[0].get('xla_bytes', 0) / 2**30:.2f} GiB), {big[0]['time_s']:.0f} s."
            + (f" Note: {big[0]['note']}." if "note" in big[0] else "")
        )
    else:
        status = big[0]["status"] if big else "not run"
        out.append(f"- CoPE at T = 32768: NOT met ({status}).")
    return out


def _load(values: list[float] | None) -> str:
    return "-" if values is None else "/".join(f"{v:.1f}" for v in values)


def markdown(result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    lines = [
        "# Benchmark: forward+backward time and memory against length",
        "",
        f"Command: `{meta['command']}` (jax {meta['jax']}, {meta['backend']}, "
        f"{meta['cpu_count']} CPUs; load averages (1, 5, 15 min) at start "
        f"{_load(meta.get('load_average_start'))}, at end {_load(meta.get('load_average_end'))}"
        f"{'; ' + meta['load_note'] if 'load_note' in meta else ''}). "
        f"B = {meta['batch']}, N = {meta['heads']}, "
        f"H = {meta['head_dim']}. Pallas: {meta['pallas']}.",
        "",
        f"Time: median of the timed runs after one warm-up (a warm-up over {LONG_RUN_S:.0f} s "
        "is itself the one timed run). Memory: XLA's buffer assignment "
        "(temporaries + arguments + outputs of the compiled program) and the worker's peak RSS "
        "(includes the Python/JAX process, about 0.3-0.5 GiB; nope, dpa and cope: one process "
        "per measurement; other schemes: one process per series of increasing T, so their RSS "
        "is the peak up to that T). Schemes stop at their first failure, "
        f"{meta['time_cap_s']} s per subprocess or {meta['memory_cap_bytes'] / 2**30:.0f} GiB "
        "predicted memory.",
    ]
    lines += ["", "## Targets (issue 8)", "", *targets(result), "", *NOTES]
    side = [r for r in rows if r["kind"] == "side_by_side"]
    if side:
        lengths = sorted({r["T"] for r in side})
        labels = list(dict.fromkeys(r["scheme"] for r in side if r["scheme"] != "all"))
        lines += [
            "",
            "## Side by side: one attention layer, interleaved rounds",
            "",
            "All arms of a length are compiled in one process, then timed in rounds that run "
            "each arm once (the order rotates between rounds). Cells: median time in ms, and "
            "the median (min-max) over rounds of the ratio to nope within the round. "
            "`cope`, `fox` and `stickbreaking` are their defaults (`attention_impl='auto'`); "
            "`naive` is the (B, N, T, S) path, `blockwise` the O(T)-memory path.",
            "",
            "| arm | " + " | ".join(f"T={t}" for t in lengths) + " |",
            "|---" * (len(lengths) + 1) + "|",
        ]
        for label in labels:
            ok, cells = _ok(rows, "side_by_side", label), []
            for t in lengths:
                if t in ok:
                    cells.append(
                        f"{1e3 * ok[t]['time_s']:.0f} ({_ratio_cell(round_ratios(rows, label, t))})"
                    )
                else:
                    status = [r["status"] for r in side if r["scheme"] in (label, "all")]
                    cells.append(status[0].replace("_", " ") if status else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for kind, title in (("layer", "One attention layer"), ("step", "One training step")):
        schemes = list(dict.fromkeys(r["scheme"] for r in rows if r["kind"] == kind))
        lengths = sorted({r["T"] for r in rows if r["kind"] == kind})
        nope = _ok(rows, kind, "nope")
        dpa = _ok(rows, kind, "dpa")
        lines += ["", f"## {title}: time in ms (ratio to nope / to dpa)", ""]
        lines.append("| scheme | " + " | ".join(f"T={t}" for t in lengths) + " |")
        lines.append("|---" * (len(lengths) + 1) + "|")
        for scheme in schemes:
            ok, cells = _ok(rows, kind, scheme), []
            failed = {
                r["T"]: r["status"] for r in rows if r["kind"] == kind and r["scheme"] == scheme
            }
            for t in lengths:
                if t in ok:
                    ratios = [
                        f"{ok[t]['time_s'] / base[t]['time_s']:.2f}x" if t in base else "-"
                        for base in (nope, dpa)
                    ]
                    cells.append(f"{1e3 * ok[t]['time_s']:.0f} ({' / '.join(ratios)})")
                else:
                    cells.append(failed.get(t, "-").replace("_", " "))
            lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
        lines += ["", f"## {title}: memory in MiB, XLA / peak RSS", ""]
        lines.append("| scheme | " + " | ".join(f"T={t}" for t in lengths) + " |")
        lines.append("|---" * (len(lengths) + 1) + "|")
        for scheme in schemes:
            ok = _ok(rows, kind, scheme)
            cells = [
                f"{ok[t].get('xla_bytes', 0) / 2**20:.0f} / {ok[t]['peak_rss_bytes'] / 2**20:.0f}"
                if t in ok
                else "-"
                for t in lengths
            ]
            lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    if "scan" in result:
        from copejax.ops.bench_scan import markdown_table

        lines += ["", "## Scan micro-benchmark (associative_scan vs lax.cumsum)", ""]
        lines.append(markdown_table(result["scan"]))
    return "\n".join(lines) + "\n"


def plots(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, scale in (("time_s", "time (s)", 1.0), ("xla_bytes", "memory (GiB)", 2**-30)):
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        for ax, kind in zip(axes, ("layer", "step"), strict=True):
            for scheme in dict.fromkeys(r["scheme"] for r in result["rows"]):
                ok = _ok(result["rows"], kind, scheme)
                points = [(t, ok[t][key] * scale) for t in sorted(ok) if key in ok[t]]
                if points:
                    style = (
                        "-" if scheme in ("cope", "nope", "dpa", "fox", "stickbreaking") else ":"
                    )
                    ax.plot(*zip(*points, strict=True), style, marker=".", label=scheme)
            ax.set(xscale="log", yscale="log", xlabel="T", ylabel=label)
            ax.set_title(f"{kind}: forward+backward" if kind == "layer" else "training step")
            ax.grid(True, which="both", alpha=0.3)
        axes[1].legend(fontsize=7, ncol=2)
        path = out_dir / ("bench_time.png" if key == "time_s" else "bench_memory.png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--out_dir", default="experiments/results")
    parser.add_argument("--schemes", default=None, help="comma-separated; default: all")
    parser.add_argument("--render", default=None, help="rewrite page and plots from a JSON")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return
    out_dir = Path(args.out_dir)
    if args.render is not None:
        result = json.loads(Path(args.render).read_text())
        (out_dir / "bench.md").write_text(markdown(result))
        plots(result, out_dir)
        return
    from copejax.ops import bench_scan

    schemes = args.schemes.split(",") if args.schemes else None
    result = run_benchmark(args.mode, schemes)
    scan_shapes = ((2, 2, 64, 64),) if args.mode == "quick" else bench_scan.DEFAULT_SHAPES
    result["scan"] = bench_scan.bench(scan_shapes, MODES[args.mode]["repeats"])
    result["meta"]["load_average_end"] = os.getloadavg()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "bench.md").write_text(markdown(result))
    for path in plots(result, out_dir):
        print(f"wrote {path}")
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'}")


if __name__ == "__main__":
    main()

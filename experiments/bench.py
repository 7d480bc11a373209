"""Benchmark of every position scheme: time and memory of attention against length (a script).

Issue 13's benchmark of the attention engine: forward+backward time and peak memory of one
attention layer (the scheme's embed site, then one ``copejax.attention.Attention`` with
projections) for every scheme over T = 1K..16K, 32K for the schemes the issue names, one
training step through the command line at 16K, and interleaved side-by-side rounds (one
process, ratios within rounds) of each scheme's default path against its naive path and the
fastest nope path. ``dpa`` is nope on ``jax.nn.dot_product_attention``. Measurements run in
subprocesses (an out-of-memory death does not stop the script); a series stops at its first
failure, time over the cap, or predicted memory over the cap (XLA's buffer assignment, read
before running). Also runs ``experiments.bench_scan``.

    .venv/bin/python -m experiments.bench --mode full     # writes experiments/results/bench.*
    .venv/bin/python -m experiments.bench --mode quick --out_dir /tmp/bench   # smoke run
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

# The repository: workers run ``-m experiments.bench`` and ``-m copejax.main`` from it.
ROOT = Path(__file__).resolve().parents[1]
MODES = {
    # layer: one attention layer's forward+backward for every scheme, one subprocess per scheme
    # with lengths ascending; long: the 32K run of LONG_SCHEMES, one subprocess each;
    # cli_step: one training step through ``python -m copejax.main`` (configs/lm.py, batch 1);
    # side_by_side: {length: arm groups} timed in interleaved rounds in one process.
    "quick": {
        "layer": [64],
        "long": [],
        "cli_step": [],
        "side_by_side": {64: ("core",)},
        "rounds": 2,
        "repeats": 1,
        "cap_s": 120,
    },
    "full": {
        "layer": [2048, 4096, 16384],
        "long": [32768],
        "cli_step": [16384],
        "side_by_side": {1024: ("core",), 4096: ("core", "every"), 16384: ("long",)},
        "rounds": 3,
        "repeats": 2,
        "cap_s": 900,
    },
}
# The side-by-side timing: every arm compiled in one process, then ``rounds`` rounds that each
# time every arm once, in an order that rotates between rounds, so that a change of machine
# load hits all arms alike; ratios are taken within a round. (label, scheme, options.) An arm
# named after a scheme alone is its default (model.attention_impl="auto").
CORE_ARMS = (
    ("nope", "nope", {}),
    ("nope naive", "nope", {"attention_impl": "naive"}),
    ("nope blockwise", "nope", {"attention_impl": "blockwise"}),
    ("dpa", "dpa", {}),
    ("cope", "cope", {}),
    ("cope naive", "cope", {"attention_impl": "naive"}),
    ("fox", "fox", {}),
    ("fox naive", "fox", {"attention_impl": "naive"}),
    ("fox remat", "fox", {"attention_impl": "blockwise", "attention_backward": "remat"}),
    ("stickbreaking", "stickbreaking", {}),
    ("stickbreaking naive", "stickbreaking", {"attention_impl": "naive"}),
)
NOPE_ARMS = ("nope", "nope naive", "nope blockwise", "dpa")
# At 16K only the defaults run (the naive paths exceed the memory cap; auto is blockwise).
LONG_ARMS = ("nope", "cope", "fox", "stickbreaking")
# The schemes the 32K target names (issue 13).
LONG_SCHEMES = ("nope", "rope", "alibi", "t5", "kerple", "cope", "fox", "stickbreaking")
# Keys of an arm's options that are model options, not the scheme's.
MODEL_KEYS = ("attention_impl", "attention_block", "attention_backward", "scan_impl")
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
            sys.executable,
            "-m",
            "copejax.main",
            f"--config=configs/lm.py:{arg}",
            f"--workdir={workdir}/run",
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
        if spec["kind"] == "cli_step":
            row = cli_step(spec["scheme"], length)
        else:
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
    command = [sys.executable, "-m", "experiments.bench", "--worker", json.dumps(spec)]
    timeout = spec["cap_s"] * len(spec["lengths"])
    rows: list[dict] = []
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
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


def side_by_side_arms(groups: tuple[str, ...], schemes: list[str]) -> list[tuple]:
    """The arms of a side-by-side length: "core" (CORE_ARMS) and "every" (each scheme's
    default against its naive path)."""
    arms = [arm for arm in CORE_ARMS if arm[1] in schemes] if "core" in groups else []
    if "long" in groups:
        arms = [arm for arm in CORE_ARMS if arm[0] in LONG_ARMS and arm[1] in schemes]
    if "every" in groups:
        labels = {label for label, _, _ in arms}
        for scheme in schemes:
            if scheme == "dpa":
                continue
            for label, options in ((scheme, {}), (f"{scheme} naive", {"attention_impl": "naive"})):
                if label not in labels:
                    arms.append((label, scheme, options))
    return arms


def run_benchmark(
    mode: str,
    schemes: list[str] | None = None,
    partial: Path | None = None,
    done: list[dict] | None = None,
) -> dict:
    """Runs ``mode``'s measurements, writing what has run to ``partial`` after each one;
    ``done`` (rows of an earlier partial run) are kept and their measurements skipped."""
    from copejax.positions import registry

    settings = MODES[mode]
    load_at_start = os.getloadavg()
    if schemes is None:
        first = ["nope", "dpa", "cope", "fox", "stickbreaking"]
        others = [name for name in registry.names() if name not in first]
        schemes = list(QUICK_SCHEMES) if mode == "quick" else first + others
    rows: list[dict] = list(done or [])
    measured = {(r["kind"], r["scheme"], r["T"]) for r in rows}
    measured |= {("side_by_side", "all", r["T"]) for r in rows if r["kind"] == "side_by_side"}

    def run(spec: dict) -> list[dict]:
        if all((spec["kind"], spec["scheme"], t) in measured for t in spec["lengths"]):
            return []
        spec = {"repeats": settings["repeats"], "cap_s": settings["cap_s"], "options": {}, **spec}
        series = _run_series(spec)
        for row in series:
            print(_row_line(row), flush=True)
        if partial is not None:  # what has run so far, renderable with --render
            done = {"meta": _meta(mode), "rows": [*rows, *series]}
            partial.write_text(json.dumps(done, indent=1) + "\n")
        return series

    def side(lengths: list[int]) -> None:
        nonlocal rows
        for length in lengths:
            arms = side_by_side_arms(settings["side_by_side"][length], schemes)
            spec = {"kind": "side_by_side", "scheme": "all", "lengths": [length], "arms": arms}
            rows += run({**spec, "rounds": settings["rounds"], "cap_s": 4 * settings["cap_s"]})

    lengths = list(settings["side_by_side"])
    side(lengths[:1])
    for scheme in schemes:
        rows += run({"kind": "layer", "scheme": scheme, "lengths": settings["layer"]})
    side(lengths[1:2])
    for length in settings["long"]:
        for scheme in (s for s in LONG_SCHEMES if s in schemes):
            rows += run({"kind": "layer", "scheme": scheme, "lengths": [length]})
    side(lengths[2:])
    for length in settings["cli_step"]:
        for scheme in (s for s in schemes if s != "dpa"):
            rows += run({"kind": "cli_step", "scheme": scheme, "lengths": [length]})
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
        "command": f"python -m experiments.bench --mode {mode}",
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
    "- An arm named after a scheme alone is its default, `model.attention_impl='auto'`: the "
    "naive (B, N, T, S) path below `copejax.attention.AUTO_BLOCKWISE_FROM` keys and the "
    "blockwise engine (`copejax.ops.engine`) from there; `naive` and `blockwise` arms force "
    "a path. Their values and gradients are equal (tests/test_blockwise_equivalence.py).",
    "- `dpa` is nope on `jax.nn.dot_product_attention` (`model.attention_impl = "
    "'dot_product_attention'`, XLA's implementation on CPU). 'The fastest nope path' is, in "
    "each round, the fastest of nope (default), nope naive, nope blockwise and dpa.",
    "- The per-scheme tables come from one process per scheme (lengths ascending), so a change "
    "of machine load between them shows in their ratios; the side-by-side rounds are the ones "
    "the speed targets read.",
    "- Peak RSS includes the Python/JAX process (about 0.3-0.5 GiB).",
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


def fastest_nope_ratios(rows: list[dict], label: str, length: int) -> list[float]:
    """Per round: ``label``'s time over the fastest nope arm of that round (NOPE_ARMS)."""
    side = _ok(rows, "side_by_side", label).get(length)
    bases = [_ok(rows, "side_by_side", arm).get(length) for arm in NOPE_ARMS]
    bases = [b for b in bases if b is not None]
    if side is None or not bases:
        return []
    fastest = [min(times) for times in zip(*(b["times_s"] for b in bases), strict=True)]
    return [a / b for a, b in zip(side["times_s"], fastest, strict=True)]


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _memory_targets(rows: list[dict]) -> list[str]:
    """16K under 4 GiB with slope <= 1.1 from 2K to 16K; 32K under 8 GiB."""
    out = [
        "- Every scheme, one layer forward+backward at T = 16384 under 4 GiB peak RSS, log-log "
        "memory slope at most 1.1 from 2K to 16K (XLA buffers / peak RSS):",
        "",
        "| scheme | peak RSS at 16K (GiB) | slope XLA | slope RSS | verdict |",
        "|---|---|---|---|---|",
    ]
    schemes = list(dict.fromkeys(r["scheme"] for r in rows if r["kind"] == "layer"))
    for scheme in schemes:
        if scheme == "dpa":  # not a scheme: XLA's kernel builds (B, N, T, S) logits
            continue
        ok = {t: r for t, r in _ok(rows, "layer", scheme).items() if t <= 16384}
        span = [t for t in sorted(ok) if 2048 <= t <= 16384]
        if 16384 not in ok:
            status = [r["status"] for r in rows if r["kind"] == "layer" and r["scheme"] == scheme]
            out.append(f"| {scheme} | {status[-1] if status else 'not run'} | - | - | NOT met |")
            continue
        slopes = [
            loglog_slope([(t, ok[t][key]) for t in span]) for key in ("xla_bytes", "peak_rss_bytes")
        ]
        peak = ok[16384]["peak_rss_bytes"] / 2**30
        met = peak < 4 and slopes[0] is not None and slopes[0] <= 1.1
        cells = ["-" if x is None else f"{x:.2f}" for x in slopes]
        out.append(f"| {scheme} | {peak:.2f} | {cells[0]} | {cells[1]} | {_verdict(met)} |")
    long = {r["scheme"]: r for r in rows if r["kind"] == "layer" and r["T"] == 32768}
    out += ["", "- At T = 32768, one layer forward+backward under 8 GiB peak RSS:", ""]
    for scheme in LONG_SCHEMES:
        row = long.get(scheme)
        if row is None:
            out.append(f"  - {scheme}: not run.")
        elif row["status"] != "ok":
            out.append(f"  - {scheme}: NOT met ({row['status'].replace('_', ' ')}).")
        else:
            peak = row["peak_rss_bytes"] / 2**30
            out.append(
                f"  - {scheme}: {_verdict(peak < 8)}, {peak:.2f} GiB peak RSS, "
                f"{row['time_s']:.0f} s."
            )
    others = [s for s in schemes if s not in LONG_SCHEMES and s != "dpa"]
    if others:
        out.append(
            f"  - not run at 32K (time on 2 cores; their 16K rows above are linear): "
            f"{', '.join(others)}."
        )
    return out


def _cli_targets(rows: list[dict]) -> list[str]:
    steps = [r for r in rows if r["kind"] == "cli_step"]
    if not steps:
        return ["- One CLI training step at T = 16384 under 6 GiB: not measured."]
    out = [
        f"- Every scheme trains the bench's small model ({STEP_MODEL}) for one step at "
        f"T = 16384 through `{steps[0].get('command', 'python -m copejax.main')}` under 6 GiB:",
        "",
        "| scheme | peak RSS (GiB) | wall time incl. start and compile (s) | verdict |",
        "|---|---|---|---|",
    ]
    for row in steps:
        if row["status"] != "ok":
            out.append(f"| {row['scheme']} | {row['status']} | - | NOT met |")
            continue
        peak = row["peak_rss_bytes"] / 2**30
        out.append(f"| {row['scheme']} | {peak:.2f} | {row['time_s']:.0f} | {_verdict(peak < 6)} |")
    return out


def _speed_targets(rows: list[dict]) -> list[str]:
    out = []
    ratios = round_ratios(rows, "nope blockwise", 1024, "nope naive")
    if ratios:
        median = statistics.median(ratios)
        out.append(
            f"- At T = 1024, blockwise nope at most 1.2x einsum (naive) nope: "
            f"{_verdict(median <= 1.2)}, {_ratio_cell(ratios)}."
        )
    every = sorted({r["scheme"] for r in rows if r["kind"] == "side_by_side" and r["T"] >= 4096})
    for length in sorted({r["T"] for r in rows if r["kind"] == "side_by_side" and r["T"] >= 4096}):
        worse, lines = [], []
        for label in every:
            naive = f"{label} naive"
            if label.endswith((" naive", " blockwise", " remat")) or label == "dpa":
                continue
            ratios = round_ratios(rows, label, length, naive)
            if not ratios:
                naive_rows = [
                    r
                    for r in rows
                    if r["kind"] == "side_by_side" and r["scheme"] == naive and r["T"] == length
                ]
                if naive_rows and naive_rows[0]["status"] != "ok":
                    lines.append(f"{label}: naive {naive_rows[0]['status'].replace('_', ' ')}")
                continue
            if statistics.median(ratios) > 1.0:
                worse.append(label)
            lines.append(f"{label} {statistics.median(ratios):.2f}x")
        if lines:
            out.append(
                f"- At T = {length}, every scheme's default path at most its naive path: "
                f"{_verdict(not worse)} (median ratio default / naive: {'; '.join(lines)})"
                + (f"; slower: {', '.join(worse)}." if worse else ".")
            )
    for label, bound in (("cope", 1.5), ("fox", 1.3), ("stickbreaking", 1.3)):
        for length in (1024, 4096, 16384):
            ratios = fastest_nope_ratios(rows, label, length)
            if not ratios:
                out.append(f"- {label} / fastest nope at T = {length}: not measured.")
                continue
            median = statistics.median(ratios)
            out.append(
                f"- {label}'s default at most {bound}x the fastest nope path at T = {length}: "
                f"{_verdict(median <= bound)}, {_ratio_cell(ratios)}."
            )
    return out


def _listing_target() -> list[str]:
    path = Path(__file__).resolve().parents[1] / "experiments/results/cope_listing_torch.md"
    if not path.exists():
        return ["- Against the CoPE paper's Listing 1 in PyTorch: not measured."]
    return [
        "- Against the CoPE paper's Listing 1 in PyTorch: see "
        "[cope_listing_torch.md](cope_listing_torch.md) (a separate script, "
        "`experiments/cope_listing_torch.py`, run in a side venv)."
    ]


def targets(result: dict) -> list[str]:
    """Issue 13's targets, each stated as met / not met with the measured numbers."""
    rows = result["rows"]
    return [
        *_speed_targets(rows),
        "",
        *_memory_targets(rows),
        "",
        *_cli_targets(rows),
        "",
        *_listing_target(),
    ]


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
        "(includes the Python/JAX process, about 0.3-0.5 GiB; one process per scheme over "
        "increasing T, so the RSS is the peak up to that T; the 32K rows have a process each). "
        "Schemes stop at their first failure, "
        f"{meta['time_cap_s']} s per subprocess or {meta['memory_cap_bytes'] / 2**30:.0f} GiB "
        "predicted memory.",
    ]
    lines += ["", "## Targets (issue 13)", "", *targets(result), "", *NOTES]
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
            "the median (min-max) over rounds of the ratio to the round's fastest nope arm. "
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
                    ratios = fastest_nope_ratios(rows, label, t)
                    cells.append(f"{1e3 * ok[t]['time_s']:.0f} ({_ratio_cell(ratios)})")
                else:
                    status = [r["status"] for r in side if r["scheme"] in (label, "all")]
                    cells.append(status[0].replace("_", " ") if status else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for kind, title in (("layer", "One attention layer"),):
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
        from experiments.bench_scan import markdown_table

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
        for ax, kind in zip(axes, ("layer", "cli_step"), strict=True):
            for scheme in dict.fromkeys(r["scheme"] for r in result["rows"]):
                ok = _ok(result["rows"], kind, scheme)
                points = [(t, ok[t][key] * scale) for t in sorted(ok) if key in ok[t]]
                if points:
                    style = (
                        "-" if scheme in ("cope", "nope", "dpa", "fox", "stickbreaking") else ":"
                    )
                    ax.plot(*zip(*points, strict=True), style, marker=".", label=scheme)
            ax.set(xscale="log", yscale="log", xlabel="T", ylabel=label)
            ax.set_title(f"{kind}: forward+backward" if kind == "layer" else "CLI training step")
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
    parser.add_argument("--resume", default=None, help="a partial JSON whose rows are kept")
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
    from experiments import bench_scan

    schemes = args.schemes.split(",") if args.schemes else None
    out_dir.mkdir(parents=True, exist_ok=True)
    done = json.loads(Path(args.resume).read_text())["rows"] if args.resume else None
    result = run_benchmark(args.mode, schemes, partial=out_dir / "bench.partial.json", done=done)
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

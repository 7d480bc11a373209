"""The benchmark's page: targets met or not, tables and plots, from ``bench.json`` (the rows
``experiments.bench`` measured). ``python -m experiments.bench --render <json>`` rewrites them.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from experiments import sweep
from experiments.bench_settings import LONG_RUN_S, LONG_SCHEMES, NOPE_ARMS, STEP_MODEL


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
    "naive (B, N, T, S) path below `copejax.model.attention_paths.AUTO_BLOCKWISE_FROM` keys "
    "(or the "
    "scheme's `auto_blockwise_from`: TAPE's 8192) and the blockwise engine "
    "(`copejax.ops.engine`) from there; `naive` and `blockwise` arms force "
    "a path. Their values and gradients are equal (tests/test_blockwise_equivalence.py).",
    "- `dpa` is nope on `jax.nn.dot_product_attention` (`model.attention_impl = "
    "'dot_product_attention'`, XLA's implementation on CPU). 'The fastest nope path' is, in "
    "each round, the fastest of nope (default), nope naive, nope blockwise and dpa.",
    "- The per-scheme tables come from one process per scheme (lengths ascending), so a change "
    "of machine load between them shows in their ratios; the side-by-side rounds are the ones "
    "the speed targets read.",
    "- Peak RSS includes the Python/JAX process (about 0.3-0.5 GiB).",
    "- Contextual schemes skip work exactly where float32 makes it zero, so their times depend "
    "on the inputs as well as the shapes: CoPE's key blocks whose every query has counted "
    "p_max - 1 gates take a row constant (`BlockTerm.settled`), and stick-breaking skips the "
    "key blocks older than a stick that is used up (log remainder below -110, "
    "`copejax.ops.engine_blocks.STICK_SPENT`). The benchmark's layer is at its initial "
    "weights, where gates are near 1/2: CoPE settles after about 2 p_max keys and a stick is "
    "used up after about 160. Before the skip (commit b2984ea), stick-breaking's layer "
    "measured 1.72x the fastest nope at T = 1024 and at 4096 (side-by-side probes, 9 and 5 "
    "rounds, CPU otherwise idle); a trained head that keeps its stick long gets less of the "
    "saving.",
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
    return sweep.median_range(ratios, digits=2, unit="x")


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
            default = _ok(rows, "side_by_side", label).get(length)
            if default is not None and default.get("path") == "naive":
                lines.append(f"{label}: the default is the naive path")
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
        *(
            f"Resumed with `{run['command']}` (load averages at start "
            f"{_load(run['load_average_start'])}, at end {_load(run['load_average_end'])})."
            for run in meta.get("resumed", [])
        ),
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
                    status = [
                        r["status"] for r in side if r["scheme"] in (label, "all") and r["T"] == t
                    ]
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

"""The page of ``experiments.bench_kernels_gpu`` (issue 45's GPU measurement), and the
dispatch entries its measurements support for ``copejax.model.measured_paths.MEASURED``."""

from __future__ import annotations

from experiments.bench_gpu import fastest_nope
from experiments.bench_measure import LEVER_KEYS

ONE_SHAPE_MARGIN = 1.2


def dispatch_entries(result: dict, source: str) -> list:
    """The measurements for ``copejax.model.measured_paths.MEASURED``: per scheme and T, the
    path of its fastest arm (default blocks only: the table names a path, not its options),
    where the same path won at every measured shape of that T and it is not what ``auto``'s
    rules take there already. Its ratio is the worst over the shapes. A kernel whose check
    failed on the device is no candidate. A length measured at one shape only admits a path
    that beat the rule's path there by at least ``ONE_SHAPE_MARGIN`` (the table applies the
    entry at every shape: a narrow win at one shape is no evidence for the others)."""
    from copejax.model.measured_paths import Measurement

    # a lever's own check (approx_log1p) gates that lever, not the scheme's entry
    checks = [row for row in result.get("check", []) if not row.get("approx_log1p")]
    failed = {row["scheme"] for row in checks if not row["ok"]}
    wins: dict[tuple[str, int], list] = {}
    for group in result["layer"]:
        best: dict[str, dict] = {}
        for row in group["rows"]:
            arm = group.get("arms", {}).get(row["scheme"])
            if arm is None or "ratio_to_fastest_nope" not in row or arm["scheme"] == "dpa":
                continue
            if not _default_options(arm):
                continue  # the table names a path, not its options
            if arm["impl"] == "kernel" and arm["scheme"] in failed:
                continue
            if arm["scheme"] not in best or row["time_s"] < best[arm["scheme"]]["time_s"]:
                best[arm["scheme"]] = {**row, "impl": arm["impl"]}
        for scheme, row in best.items():
            row["rule"] = group["rules"][scheme]
            row["margin"] = _margin(group, scheme, row)
            wins.setdefault((scheme, group["T"]), []).append(row)
    entries = []
    for (scheme, length), rows in sorted(wins.items()):
        impls = {row["impl"] for row in rows}
        narrow = len(rows) == 1 and rows[0]["margin"] < ONE_SHAPE_MARGIN
        if len(impls) == 1 and impls != {rows[0]["rule"]} and not narrow:
            ratio = max(row["ratio_to_fastest_nope"] for row in rows)
            entries.append(
                Measurement("gpu", "bfloat16", scheme, length, impls.pop(), ratio, source)
            )
    return entries


def _default_options(arm: dict) -> bool:
    """Whether the arm runs its path with the defaults (no block length, warps or sums
    lever)."""
    return not {"attention_block", *LEVER_KEYS} & set(arm["options"])


def _margin(group: dict, scheme: str, best: dict) -> float:
    """The time of the path ``auto``'s rules take for ``scheme`` in ``group`` (for nope on
    cuDNN, the ``dpa`` arm) over ``best``'s; infinity where that path was not measured."""
    rule = group["rules"][scheme]
    for row in group["rows"]:
        arm = group.get("arms", {}).get(row["scheme"])
        if arm is None or "time_s" not in row or not _default_options(arm):
            continue
        on_cudnn = arm["scheme"] == "dpa" and (scheme, rule) == ("nope", "dot_product_attention")
        if on_cudnn or (arm["scheme"], arm["impl"]) == (scheme, rule):
            return row["time_s"] / best["time_s"]
    return float("inf")


def _check_line(row: dict) -> str:
    from experiments.kernel_check import KV_HEADS

    groups, kv_heads = row.get("carry_groups"), row.get("kv_heads", KV_HEADS)
    name = row["scheme"] + (
        "" if groups is None else f" ({groups} carry group{'s' * (groups > 1)})"
    )
    name += "" if kv_heads == KV_HEADS else f" ({kv_heads} key/value heads)"
    name += " (log1p as lg2.approx)" if row.get("approx_log1p") else ""
    if "error" in row:
        return f"| {name} | - | - | - | no: {row['error']} |"
    return (
        f"| {name} | {row['logits_rel_error']:.2e} | {row['grad_rel_error']:.2e} | "
        f"{row['bound']:.2e} | {'yes' if row['ok'] else 'NO'} |"
    )


def _warm_lines(result: dict) -> list[str]:
    """What the warm part did, and how many of the timed layer groups' programs came from
    the persistent cache (``experiments.bench_kernels_warm``); none for a run without it."""
    warm = result.get("warm")
    counts = [group["cache"] for group in result["layer"] if "cache" in group]
    if warm is None and not counts:
        return []
    lines = ["", "## Compilation ahead of the timed part", ""]
    if warm is not None and not warm.get("served", True):
        lines.append(
            f"- Warm part (`experiments/bench_kernels_warm.py`): its probe, one arm compiled "
            f"twice, did not read the persistent cache the second time ({warm['probe']}), so "
            f"it stopped after {warm['wall_s']:.0f} s and each timed process compiled its own "
            "programs. Rerun with `--warm_workers 0` to save that time."
        )
    elif warm is not None:
        errors = "; ".join(f"{e['what'][2]}: {e['error']}" for e in warm["compile_errors"])
        lines.append(
            f"- Warm part (`experiments/bench_kernels_warm.py`): {warm['workers']} worker "
            f"processes finished {warm['done']} of {warm['jobs']} jobs (the checks, and "
            f"{warm['compiled']} layer arms compiled) and {warm['cli_done']} of "
            f"{warm['cli_runs']} command-line runs finished, in {warm['wall_s']:.0f} s."
            + (f" Arms that failed to compile: {errors}." if errors else "")
        )
    if counts:
        hits, misses = (sum(c[key] for c in counts) for key in ("hits", "misses"))
        lines.append(
            f"- The timed layer groups read {hits} programs from the persistent cache and "
            f"compiled {misses} (a miss: a program that no process had compiled before, "
            "or that the warm part traced otherwise than the timed process)."
        )
    return lines


def page(result: dict) -> str:
    """The markdown page of one run."""
    lines = [
        "# Fused attention kernels on a GPU (issue 45)",
        "",
        f"Measured {result['date']} on {result['device']}; {result['wall_s']:.0f} s in all, "
        "compilation included.",
        "",
        f"Command: `{result['command']}`",
        "",
        "## Kernel = naive on this device",
        "",
        "A one-layer bfloat16 model (GQA, packed documents, five key tiles) on the kernels and "
        "on the naive path (`experiments/kernel_check.py`): max |kernel - naive| over max "
        "|naive| of the logits and of the gradients. A scheme that fails here has no speed "
        "worth reading below, and no entry for auto.",
        "",
        "| scheme | logits | gradients | bound | ok |",
        "|---|---|---|---|---|",
        *[_check_line(row) for row in result.get("check", [])],
        "",
        "## One layer, forward + backward, bfloat16",
        "",
        "Ratio = median over interleaved rounds of the arm's time over the round's fastest "
        "nope arm (cuDNN's fused kernel `dpa` or copejax's own `nope kernel`, whichever was "
        "faster in that round). Time = back-to-back calls over one sync, per call. XLA temp = "
        "the compiled program's temporary buffers. Targets (issue 45): FoX, ALiBi and T5 at "
        "most 1.5x, stick-breaking at most 2x, CoPE and selective at most 2.5x; XLA "
        "temporaries at 16K within 1.2x of cuDNN nope's.",
        "",
        "| B | N | H | T | arm | path | time ms | ratio | XLA temp MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for group in result["layer"]:
        for row in group["rows"]:
            time_ms = f"{1e3 * row['time_s']:.2f}" if "time_s" in row else row["status"]
            if "error" in row:
                time_ms = f"error: {row['error']}"
            ratio = row.get("ratio_to_fastest_nope")
            lines.append(
                f"| {group['B']} | {group['N']} | {group['H']} | {group['T']} | "
                f"{row['scheme']} | {row.get('path', '-')} | {time_ms} | "
                f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
                f"{row.get('xla_temp_bytes', 0) / 2**20:.0f} |"
            )
        lines.append(f"|  |  |  |  | fastest nope: {fastest_nope(group)} |  |  |  |  |")
    lines += ["", "## Through the command line", ""]
    lines += [
        "Steady-state tokens/s (the last progress line), as a fraction of RoPE's at the same "
        "T and batch. Targets: CoPE, FoX and stick-breaking at least 0.6x at T = 2048 (batch "
        "8) and 0.5x at T = 8192 (batch 2).",
        "",
        "| T | batch | scheme | attention_impl | status | tokens/s | vs rope |",
        "|---|---|---|---|---|---|---|",
    ]
    size = lambda r: (r.get("T"), r.get("batch"))
    ropes = {size(r): r for r in result["cli"] if r["scheme"] == "rope" and "tokens_per_s" in r}
    for row in result["cli"]:
        speed, rope = row.get("tokens_per_s"), ropes.get(size(row))
        versus = f"{speed / rope['tokens_per_s']:.2f}x" if speed and rope else "-"
        status = row["status"] if row["status"] != "refused" else f"refused: {row['reason']}"
        shown = f"{speed:,.0f}" if speed else "-"
        length, batch = (x or "-" for x in size(row))
        lines.append(
            f"| {length} | {batch} | {row['scheme']} | {row['attention_impl']} | {status} | "
            f"{shown} | {versus} |"
        )
    lines += _warm_lines(result)
    if result.get("notes"):
        lines += ["", "## Notes", "", *[f"- {note}" for note in result["notes"]]]
    if result["skipped"]:
        lines += ["", "Skipped (time budget): " + "; ".join(result["skipped"]) + "."]
    lines += ["", "## What auto should take", ""]
    entries = dispatch_entries(result, f"experiments/results/bench_kernels_gpu.md {result['date']}")
    if entries:
        lines += [
            "Where one path beat auto's rules at every measured shape of a length (by at least "
            f"{ONE_SHAPE_MARGIN}x where one shape was measured), the entry "
            "for `MEASURED` in `copejax/model/measured_paths.py` (commit them with this page):",
            "",
            "```python",
            f'SOURCE = "{entries[0].source}"',
            "MEASURED = (",
            *[
                f'    Measurement("{m.backend}", "{m.dtype}", "{m.scheme}", {m.keys}, '
                f'"{m.impl}", {m.ratio:.3g}, SOURCE),'
                for m in entries
            ],
            ")",
            "```",
        ]
    else:
        lines.append("No path beat auto's rules at every measured shape of a length.")
    return "\n".join(lines) + "\n"

"""The length-generalisation page's tables and its reading: accuracy and step time per arm
and task, copejax beside x-transformers and the probes, and the sentences that rank the arms
against each other and the repeat rule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from experiments import sweep
from experiments.length_generalization_arms import (
    INIT_PROBE_ARMS,
    INITS,
    PEER_PROBE_ARMS,
    REPEAT_RULE,
    SPLITS,
    label,
    probe_label,
)
from experiments.length_generalization_results import summarize
from experiments.permutation_test import permutation_p


def same_function_section(same: Mapping[str, Mapping[str, Any]]) -> str:
    """Per arm: the largest logit difference (and the largest logit, for scale) with copejax's
    weights in the peer, copejax's loss at the first and last compared step, and the largest
    loss difference between the two over those steps."""
    rows = [
        [
            f"`{arm}`",
            f"{found['max_abs_difference']:.1e}",
            f"{found['max_abs_logit']:.2f}",
            f"{found['losses'][0]:.4f} → {found['losses'][-1]:.4f}",
            f"{found['max_loss_difference']:.1e}",
        ]
        for arm, found in same.items()
    ]
    header = ["arm", "largest logit difference", "largest logit",
              "copejax's loss, first → last step", "largest loss difference"]  # fmt: skip
    return sweep.markdown_table(header, rows)


def table(
    summary: Mapping[str, Mapping[str, Any]],
    tasks: Sequence[str],
    split: str,
    repeat: Mapping[str, Mapping[str, Mapping[str, float]]],
) -> str:
    """Rows: arms, then the repeat rule; columns: tasks; cells: accuracy % mean ± std over
    seeds (the rule's: one number, from ``repeat`` as :func:`repeat_rule` gives it)."""
    rows = []
    for arm, by_task in summary.items():
        cells = []
        for task in tasks:
            cell = by_task.get(task)
            cells.append("-" if cell is None else _cell(cell[split]))
        rows.append([f"`{arm}`", *cells])
    rows.append(
        [f"*{REPEAT_RULE}*", *(f"*{100 * repeat[t][split]['accuracy']:.1f}*" for t in tasks)]
    )
    return sweep.markdown_table(["arm", *(f"{t} %" for t in tasks)], rows)


def time_table(summary: Mapping[str, Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """Rows: arms; columns: tasks; cells: ms per training step, the median over seeds and
    the fastest and slowest seed."""
    rows = [
        [
            f"`{arm}`",
            *(
                sweep.median_range(by_task[t]["step_ms"]["per_seed"]) if t in by_task else "-"
                for t in tasks
            ),
        ]
        for arm, by_task in summary.items()
    ]
    return sweep.markdown_table(["arm", *(f"{t} ms/step" for t in tasks)], rows)


def _cell(spread: Mapping[str, Any]) -> str:
    return sweep.percent((spread["mean"], spread["std"]))


def reading(
    summary: Mapping[str, Mapping[str, Any]],
    tasks: Sequence[str],
    repeat: Mapping[str, Mapping[str, Mapping[str, float]]],
) -> str:
    """Per task, the arms ranked by accuracy on the test lengths and whether the best is ahead
    of the runner-up on every seed; where some arm has every seed at or below the repeat rule
    on the test lengths, the arms whose every seed is above it and those at or below it."""
    lines = []
    for task in tasks:
        lines.extend(_reading_of(summary, task))
        floor = repeat[task]["long"]["accuracy"]
        seeds = {arm: by[task]["long"]["per_seed"] for arm, by in summary.items() if task in by}
        below = [arm for arm, values in seeds.items() if max(values) <= floor]
        if not below:
            continue
        above = [arm for arm, values in seeds.items() if min(values) > floor]
        lines.append(
            f"On `{task}` the {REPEAT_RULE} scores {100 * floor:.1f} %:"
            + (f" every seed of {_code_list(above)} is above it," if above else "")
            + f" every seed of {_code_list(below)} at or below it."
        )
    return " ".join(lines)


def _code_list(names: Sequence[str]) -> str:
    """``a``, ``b``, ... as markdown code, comma-separated."""
    return ", ".join(f"`{name}`" for name in names)


def _reading_of(summary: Mapping[str, Mapping[str, Any]], task: str) -> list[str]:
    """The ranking sentence of one task (none with fewer than two arms)."""
    scores = {arm: by_task[task]["long"] for arm, by_task in summary.items() if task in by_task}
    if len(scores) < 2:
        return []
    ranked = sorted(scores, key=lambda arm: -scores[arm]["mean"])
    best, second = ranked[0], ranked[1]
    tied = [arm for arm in ranked if scores[arm]["mean"] == scores[best]["mean"]]
    if len(tied) > 1:
        return [
            f"`{task}`: {len(tied)} arms tie on the test lengths at "
            f"{100 * scores[best]['mean']:.1f} % ({_code_list(tied)})."
        ]
    clear = min(scores[best]["per_seed"]) > max(scores[second]["per_seed"])
    return [
        f"`{task}`: best on the test lengths `{best}` {100 * scores[best]['mean']:.1f} %, "
        f"then `{second}` {100 * scores[second]['mean']:.1f} % "
        f"({'ahead on every seed' if clear else 'the seeds overlap'})."
    ]


def within_spread(mine: Mapping[str, Any], theirs: Sequence[float]) -> str:
    """Whether copejax's mean (a ``sweep.spread``) and the peer's seeds' mean agree: "yes"
    when they differ by no more than the larger of the two seed stds, else "no" with the gap
    in points; either way with the two-sided p of the exact permutation test of the two
    sets of seeds (``permutation_test.permutation_p``). "n/a" when either side has a single
    seed (no spread to judge by)."""
    mean, std = sweep.mean_std(theirs)
    gap = abs(mine["mean"] - mean)
    if min(len(theirs), len(mine["per_seed"])) < 2:
        return f"n/a, one seed (gap {100 * gap:.1f})"
    p = f"p = {permutation_p(mine['per_seed'], theirs):.2g}"
    return f"yes ({p})" if gap <= max(mine["std"], std) else f"no (gap {100 * gap:.1f}, {p})"


def peer_section(
    summary: Mapping[str, Mapping[str, Any]],
    peer: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    tasks: Sequence[str],
) -> str:
    """copejax beside x-transformers per shared arm and task: test-length accuracy and ms per
    step, and whether the means agree within the larger of the two seed spreads."""
    rows = []
    for arm, by_task in peer.items():
        for task in tasks:
            if task not in by_task or task not in summary.get(arm, {}):
                continue
            mine = summary[arm][task]
            values = [r["long/accuracy"] for r in by_task[task]]
            theirs = sweep.mean_std(values)
            times = [r["step_ms"] for r in by_task[task]]
            rows.append(
                [
                    f"`{arm}`",
                    task,
                    _cell(mine["long"]),
                    sweep.percent(theirs),
                    within_spread(mine["long"], values),
                    sweep.median_range(mine["step_ms"]["per_seed"]),
                    sweep.median_range(times),
                ]
            )
    header = ["arm", "task", "copejax %", "x-transformers %", "within the seed spread",
              "copejax ms/step", "x-transformers ms/step"]  # fmt: skip
    return sweep.markdown_table(header, rows)


def init_probe_section(
    result: sweep.Sweep,
    peer: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    tasks: Sequence[str],
) -> str:
    """Per probed arm and task: accuracy on the training and the test lengths with copejax's
    initialisation, with the torch-scale one, and x-transformers' (mean ± std over seeds)."""
    mine = summarize(result, tasks, INIT_PROBE_ARMS)
    probe = summarize(result, tasks, INIT_PROBE_ARMS, probe_label)
    rows = []
    for task in tasks:
        for arm in INIT_PROBE_ARMS:
            if task not in probe.get(arm, {}):
                continue
            runs = peer.get(arm, {}).get(task, [])
            cells = []
            for split in ("test", "long"):
                cells += [_cell(mine[arm][task][split]), _cell(probe[arm][task][split])]
                values = [r[f"{split}/accuracy"] for r in runs]
                cells.append(sweep.percent(sweep.mean_std(values)) if values else "-")
            peer_long = [r["long/accuracy"] for r in runs]
            for start in (mine, probe):
                cells.append(within_spread(start[arm][task]["long"], peer_long) if runs else "-")
            rows.append([f"`{arm}`", task, *cells])
    header = ["arm", "task"] + [
        f"{where}: {who}"
        for where in ("training lengths %", "test lengths %")
        for who in (*INITS, "x-transformers")
    ]
    header += [f"test lengths: {who} within the peer's seed spread" for who in INITS]
    return sweep.markdown_table(header, rows)


def peer_probe_section(
    summary: Mapping[str, Mapping[str, Any]],
    peer: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    probe: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
    tasks: Sequence[str],
) -> str:
    """Per probed arm and task: accuracy on the training and the test lengths of copejax,
    x-transformers, and x-transformers in copejax's parametrisation (mean ± std over seeds),
    and whether each peer's test-length mean is within the seed spread of copejax's."""
    rows = []
    for task in tasks:
        for arm in PEER_PROBE_ARMS:
            if task not in probe.get(arm, {}) or task not in summary.get(arm, {}):
                continue
            theirs = [peer.get(arm, {}).get(task, []), probe[arm][task]]
            cells = []
            for split in ("test", "long"):
                cells.append(_cell(summary[arm][task][split]))
                for runs in theirs:
                    values = [r[f"{split}/accuracy"] for r in runs]
                    cells.append(sweep.percent(sweep.mean_std(values)) if values else "-")
            for runs in theirs:
                values = [r["long/accuracy"] for r in runs]
                cells.append(within_spread(summary[arm][task]["long"], values) if runs else "-")
            per_seed = " / ".join(f"{100 * r['long/accuracy']:.1f}" for r in probe[arm][task])
            rows.append([f"`{arm}`", task, *cells, per_seed])
    peers = ("x-transformers", "x-transformers, copejax's parametrisation")
    header = ["arm", "task"] + [
        f"{where}: {who}"
        for where in ("training lengths %", "test lengths %")
        for who in ("copejax", *peers)
    ]
    header += [f"test lengths: {who} within copejax's seed spread" for who in peers]
    header += ["test lengths %, every seed: x-transformers, copejax's parametrisation"]
    return sweep.markdown_table(header, rows)


def peer_per_seed(
    peer: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], tasks: Sequence[str]
) -> str:
    """Every x-transformers seed's accuracy on the test and the training lengths, as
    ``sweep.per_seed_table`` lists copejax's."""
    rows = [
        [
            label(task, arm),
            *(
                " / ".join(f"{100 * r[f'{split}/accuracy']:.1f}" for r in by_task[task])
                for split in SPLITS
            ),
        ]
        for arm, by_task in peer.items()
        for task in tasks
        if task in by_task
    ]
    return sweep.markdown_table(["arm", *(f"{SPLITS[s]} %" for s in SPLITS)], rows)

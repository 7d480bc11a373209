"""Study: length generalisation on the task suite of Ruoss et al. 2023 (arXiv 2305.16843),
"Randomized positional encodings boost length generalization of transformers".

    python -m experiments.length_generalization --scale=smoke  # about a minute: 1 task, 8 arms
    python -m experiments.length_generalization --scale=cpu    # the page (hours on 2 cores)
    python -m experiments.length_generalization --scale=paper  # their example's sizes

Every task of ``configs/length_generalization.py`` with every copejax arm (NoPE, sinusoidal,
RoPE, ALiBi, learned, CoPE, FoX, randomized positions) over seeds: train on input lengths 1
to 40, report the per-output-token accuracy averaged over the test lengths (the ``long``
split, 41 and up) and over the training lengths (``test``), mean ± std over seeds, and each
arm's training step time (median of the logged steps/s after the first window, which holds
the compilation).

Not done yet (issue 19's second half): the x-transformers peer run side by side on the same
data, sizes, steps and seeds. The page says so rather than leaving an empty column.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import sweep

STUDY = "length_generalization"
CONFIG = "configs/length_generalization.py"
TASKS = (
    "reverse_string",
    "duplicate_string",
    "odds_first",
    "bucket_sort",
    "missing_duplicate",
    "binary_addition",
    "parity_check",
)
ARMS = ("nope", "sinusoidal", "rope", "alibi", "learned", "cope", "fox", "randomized")
SCALE_TASKS = {"smoke": ("reverse_string",), "cpu": TASKS, "paper": TASKS}
ARGS = {"smoke": "smoke,steps=10", "cpu": "cpu", "paper": "paper"}
SEEDS = {"smoke": 1, "cpu": 3, "paper": 3}
SPLITS = {"long": "test lengths (41 and up)", "test": "training lengths (1 to 40)"}
NOTES = {
    "smoke": "Smoke scale: 10 steps of a tiny model on inputs of 1 to 8 symbols, tested at 9, "
    "13 and 17; checks the pipeline only.",
    "cpu": """The `cpu` scale: the protocol's training lengths (1 to 40, drawn per example),
tested at 41 to 161 in steps of 8 with 16 sequences per length; a 3-layer, D = 64, 4-head
model, 2,000 steps of batch 32 at lr 1e-3. Their example trains a 5-layer model for 10,000
steps of batch 128 (the `paper` scale) and evaluates 512 sequences per length.""",
    "paper": """The `paper` scale: their `experiments/example.py` (5 layers, D = 64, 8 heads,
MLP 4 D, dropout 0.1, batch 128, 10,000 steps, Adam lr 1e-3, clip 1), tested at 41 to 500
with 512 sequences per length; meant for an accelerator.""",
}
DIFFERENCES = """How this differs from Ruoss et al.: their model is an encoder (post-norm,
bidirectional attention) that reads the input followed by one empty query per output token and
emits all outputs at once; copejax's is a causal pre-norm decoder that reads `input <sep>
output` and predicts each output token from the true previous ones (teacher forcing; greedy
argmax scored per token, as their accuracy is). Their batches share one length (drawn per
batch); here lengths are drawn per example and padded. Their `experiments/example.py` trains
the randomised relative encoding (`NOISY_RELATIVE`, Transformer-XL's with randomised
positions); copejax's `randomized` arm randomises sinusoidal absolute positions (its default
`encoding`) and is evaluated at positions 0 to T - 1: the scheme's default
(`sample_at_eval=False`), because copejax's evaluation step passes no positions rng, where
their code samples random positions at test time too.

Published numbers: the paper's results table is not retrievable offline (only its abstract
and introduction are), so no published column is shown."""


def label(task: str, arm: str) -> str:
    return f"{task}, {arm}"


def step_ms(records: Sequence[Mapping[str, float]]) -> float:
    """Milliseconds per training step: 1000 / the median logged steps/s, the first logged
    window (compilation) left out when there are others."""
    speeds = [r["train/steps_per_sec"] for r in records if "train/steps_per_sec" in r]
    speeds = speeds[1:] if len(speeds) > 1 else speeds
    return 1000.0 / statistics.median(speeds) if speeds else float("nan")


def summarize(result: sweep.Sweep, tasks: Sequence[str]) -> dict[str, dict[str, Any]]:
    """arm -> task -> {split: spread of accuracy, "step_ms": spread}."""
    out: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        for task in tasks:
            key = label(task, arm)
            if key not in result.records:
                continue
            cell: dict[str, Any] = {}
            for split in SPLITS:
                values = result.final(key, f"{split}/accuracy")
                cell[split] = sweep.spread(*sweep.mean_std(values), values)
            times = [step_ms(r) for r in result.records[key]]
            cell["step_ms"] = sweep.spread(*sweep.mean_std(times), times)
            out.setdefault(arm, {})[task] = cell
    return out


def table(summary: Mapping[str, Mapping[str, Any]], tasks: Sequence[str], split: str) -> str:
    """Rows: arms; columns: tasks; cells: accuracy % mean ± std over seeds."""
    rows = []
    for arm, by_task in summary.items():
        cells = []
        for task in tasks:
            cell = by_task.get(task)
            cells.append("-" if cell is None else _cell(cell[split]))
        rows.append([f"`{arm}`", *cells])
    return sweep.markdown_table(["arm", *(f"{t} %" for t in tasks)], rows)


def time_table(summary: Mapping[str, Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """Rows: arms; columns: tasks; cells: ms per training step, mean ± std over seeds."""
    rows = [
        [f"`{arm}`", *(_cell(by_task[t]["step_ms"], 1.0) if t in by_task else "-" for t in tasks)]
        for arm, by_task in summary.items()
    ]
    return sweep.markdown_table(["arm", *(f"{t} ms/step" for t in tasks)], rows)


def _cell(spread: Mapping[str, Any], scale: float = 100.0) -> str:
    return sweep.percent((spread["mean"], spread["std"]), scale=scale)


def reading(summary: Mapping[str, Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """Per task, the arms ranked by accuracy on the test lengths, and whether the best is
    ahead of the runner-up on every seed."""
    lines = []
    for task in tasks:
        scores = {arm: by_task[task]["long"] for arm, by_task in summary.items() if task in by_task}
        if len(scores) < 2:
            continue
        ranked = sorted(scores, key=lambda arm: -scores[arm]["mean"])
        best, second = ranked[0], ranked[1]
        tied = [arm for arm in ranked if scores[arm]["mean"] == scores[best]["mean"]]
        if len(tied) > 1:
            lines.append(
                f"`{task}`: {len(tied)} arms tie on the test lengths at "
                f"{100 * scores[best]['mean']:.1f} % ({', '.join(f'`{a}`' for a in tied)})."
            )
            continue
        clear = min(scores[best]["per_seed"]) > max(scores[second]["per_seed"])
        lines.append(
            f"`{task}`: best on the test lengths `{best}` {100 * scores[best]['mean']:.1f} %, "
            f"then `{second}` {100 * scores[second]['mean']:.1f} % "
            f"({'ahead on every seed' if clear else 'the seeds overlap'})."
        )
    return " ".join(lines)


def main(argv: Sequence[str] | None = None) -> Path:
    args = sweep.parse_args(argv, STUDY)
    tasks = SCALE_TASKS[args.scale]
    arms = [
        sweep.Arm(label(task, arm), CONFIG, f"{task},{ARGS[args.scale]},position={arm}")
        for task in tasks
        for arm in ARMS
    ]
    result = sweep.run_sweep(
        STUDY, args.scale, arms, sweep.seeds_for(args, SEEDS[args.scale]), args.workroot
    )
    summary = summarize(result, tasks)
    plot = sweep.plot_path(args.out, STUDY, args.scale, "accuracy")
    sweep.bar_plot(
        list(tasks),
        {
            arm: [(c["long"]["mean"], c["long"]["std"]) for c in by.values()]
            for arm, by in summary.items()
        },
        plot,
        ylabel="accuracy on the test lengths",
        title="Length generalisation (Ruoss et al. 2023 tasks)",
    )
    page = "\n".join(
        [
            sweep.header(
                "Length generalisation on the Ruoss et al. 2023 tasks (arXiv 2305.16843)",
                args.scale,
                result,
                NOTES[args.scale],
            ),
            DIFFERENCES,
            "",
            "## Accuracy on the test lengths",
            "",
            "Per-output-token accuracy of each test length, averaged over the lengths (their "
            "score), last evaluation, mean ± std over seeds.",
            "",
            table(summary, tasks, "long"),
            "",
            f"![accuracy]({plot.name})",
            "",
            reading(summary, tasks),
            "",
            "## Accuracy on the training lengths",
            "",
            table(summary, tasks, "test"),
            "",
            "## Step time",
            "",
            "Milliseconds per training step (1000 / the median logged steps/s after the "
            "first window), mean ± std over seeds.",
            "",
            time_table(summary, tasks),
            "",
            "## Peer implementation",
            "",
            "Not run yet: the x-transformers (PyTorch) arms on the same generated data, sizes, "
            "steps and seeds, with their step times beside these, are issue 19's second half.",
            "",
            sweep.commands_block(STUDY, args.scale, result),
        ]
    )
    return sweep.write_outputs(args.out, STUDY, args.scale, page, result, results=summary)


if __name__ == "__main__":
    main()

"""Study 6: the addition heatmap (TAPE Figure 2) and passkey accuracy against length (TAPE
Figure 3), at a reduced size (Zhu et al. 2025, arXiv 2501.00712; addition as in McLeish et al.
2024, arXiv 2405.17399; passkey as in Mohtashami and Jaggi 2023, arXiv 2305.16300).

    python -m experiments.tape_tasks --scale=cpu    # experiments/results/tape_tasks.md
    python -m experiments.tape_tasks --scale=paper  # the papers' settings, for accelerators
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from copejax.data.addition import accuracy_grid
from copejax.plots.addition import write_heatmap
from experiments import sweep

STUDY = "tape_tasks"
ADDITION = "configs/addition.py"
PASSKEY = "configs/passkey.py"
# TAPE Figure 2: mean accuracy (%) over the 50 x 50 heatmap (trained up to 40 digits).
# "randomized" is RandPE.
PAPER_ADDITION = {"rope": 26.32, "randomized": 26.56, "nope": 22.45, "fire": 26.98, "tape": 32.82}
ADDITION_SCHEMES = {
    "smoke": ("tape",),
    "cpu": ("learned", "rope", "cope", "tape"),
    "paper": ("learned", "rope", "randomized", "nope", "fire", "cope", "tape"),
}
PASSKEY_SCHEMES = {
    "smoke": ("tape",),
    "cpu": ("learned", "rope", "cope", "tape"),
    "paper": ("learned", "rope", "cope", "tape"),
}
ADDITION_ARGS = {
    "smoke": "smoke",
    "cpu": "cpu,steps=300,d_model=64,layers=2,digits=4,extra=2,per_pair=4",
    "paper": "paper",
}
PASSKEY_ARGS = {"smoke": "smoke", "cpu": "cpu,steps=200", "paper": "paper"}
SEEDS = {"smoke": 1, "cpu": 3, "paper": 3}
NOTES = {
    "smoke": "Smoke scale: 20 steps of tiny models; checks the pipeline only.",
    "cpu": """The `cpu` scale. Addition: operands of 1 to 4 digits in training and a 6 x 6 grid
(paper: up to 40 digits, a 50 x 50 grid with 100 sums per cell), 4 sums per cell, D = 64,
2 layers, 4 heads, 300 steps of batch 64 at lr 1e-3 (paper: 16 layers, D = 1024, 20k steps of
batch 512). Passkey: a D = 64, 2-layer model trained from scratch at T = 128 for 200 steps and
evaluated at 128, 256 and 512 (paper: Llama2-7B fine-tuned from 4096 to 8192 tokens and tested
from 1k to 8k). Models this small and
this briefly trained get little of the grid right past the training lengths, so the averages
compare early learning, not the converged generalisation of the paper.""",
    "paper": """The `paper` scale is TAPE 4.1 (addition, 40 digits, grid to 50, 16 layers, D = 1024,
batch 512, 20k steps) and our from-scratch passkey stand-in for TAPE 4.3 (D = 768, 12 layers,
T = 4096, evaluated to 8192); meant for accelerators and not run here.""",
}


def main(argv: Sequence[str] | None = None) -> None:
    args = sweep.parse_args(argv, STUDY)
    seeds = sweep.seeds_for(args, SEEDS[args.scale])
    add_arms = [
        sweep.Arm(f"addition {s}", ADDITION, f"{ADDITION_ARGS[args.scale]},position={s}")
        for s in ADDITION_SCHEMES[args.scale]
    ]
    key_arms = [
        sweep.Arm(f"passkey {s}", PASSKEY, f"{PASSKEY_ARGS[args.scale]},position={s}")
        for s in PASSKEY_SCHEMES[args.scale]
    ]
    result = sweep.run_sweep(
        STUDY, args.scale, add_arms + key_arms, seeds, args.workroot, args.jobs
    )

    # Addition: the grid of every seed, their mean, and the heatmap's average accuracy.
    add_rows, images, add_data = [], [], {}
    for arm in add_arms:
        scheme = arm.label.removeprefix("addition ")
        grids = [_grid(last) for last in (sweep.last_eval(r) for r in result.records[arm.label])]
        averages = [float(np.nanmean(g)) for g in grids]
        tests = result.final(arm.label, "test/accuracy")
        mean_grid = np.nanmean(np.stack(grids), axis=0)
        image = sweep.plot_path(args.out, STUDY, args.scale, f"addition_{scheme}")
        write_heatmap(
            mean_grid, image, f"{scheme}: mean over seeds, average {np.nanmean(mean_grid):.1%}"
        )
        images.append(image)
        paper = PAPER_ADDITION.get(scheme)
        add_rows.append(
            [
                scheme,
                sweep.percent(sweep.mean_std(tests)),
                sweep.percent(sweep.mean_std(averages)),
                "-" if paper is None else f"{paper:g}",
            ]
        )
        add_data[scheme] = {
            "test_accuracy": tests,
            "grid_average": averages,
            "mean_grid": mean_grid.tolist(),
        }
    add_table = sweep.markdown_table(
        ["scheme", "in-distribution accuracy %", "grid average accuracy %", "paper average %"],
        add_rows,
    )

    # Passkey: accuracy at each evaluation length.
    lengths = sorted(
        {
            int(k.split("/")[0].removeprefix("len_"))
            for r in result.records[key_arms[0].label]
            for k in sweep.last_eval(r)
            if k.startswith("len_") and k.endswith("/accuracy")
        }
    )
    key_rows, curves, key_data = [], {}, {}
    for arm in key_arms:
        scheme = arm.label.removeprefix("passkey ")
        per_length = {n: result.final(arm.label, f"len_{n}/accuracy") for n in lengths}
        key_rows.append([scheme, *(sweep.percent(sweep.mean_std(v)) for v in per_length.values())])
        curves[scheme] = [
            [(n, per_length[n][i]) for n in lengths] for i in range(len(result.seeds))
        ]
        key_data[scheme] = per_length
    key_table = sweep.markdown_table(["scheme", *(f"accuracy at {n} %" for n in lengths)], key_rows)
    key_plot = sweep.plot_path(args.out, STUDY, args.scale, "passkey")
    sweep.curve_plot(
        curves,
        key_plot,
        xlabel="context length (tokens)",
        ylabel="passkey accuracy",
        title=f"Passkey accuracy, trained at {lengths[0]} (TAPE Fig. 3 analogue)",
    )

    page = "\n".join(
        [
            sweep.header(
                "Study 6: addition heatmap and passkey (TAPE Figures 2 and 3)",
                args.scale,
                result,
                NOTES[args.scale],
            ),
            "## Addition (TAPE Figure 2)",
            "",
            "Exact-match accuracy of whole sums, last evaluation, mean ± std over seeds: on the "
            "in-distribution test set and averaged over the operand-length grid (the paper's "
            "number is the average over its 50 x 50 heatmap at twice the training length; "
            "ours is over a grid 1.5 times the training length).",
            "",
            add_table,
            "",
            *(f"![{p.stem}]({p.name})\n" for p in images),
            "## Passkey (TAPE Figure 3)",
            "",
            "Accuracy of the retrieved key at each context length, mean ± std over seeds. "
            "TAPE's Figure 3 gives its curves only as a plot (TAPE near 100 % from 1k to 8k "
            "after fine-tuning Llama2-7B), so there is no paper column.",
            "",
            key_table,
            "",
            f"![passkey]({key_plot.name})",
            "",
            "## Reading",
            "",
            reading(add_data, key_data),
            "",
            "## Commands",
            "",
            sweep.commands_block(STUDY, args.scale, result),
        ]
    )
    path = sweep.write_outputs(
        args.out,
        STUDY,
        args.scale,
        page,
        result,
        addition=add_data,
        passkey={s: {str(n): v for n, v in d.items()} for s, d in key_data.items()},
        paper_addition_average_percent=PAPER_ADDITION,
    )
    print(add_table)
    print(key_table)
    print(f"wrote {path}")


def _grid(last: dict[str, float]) -> np.ndarray:
    pairs = {k.removeprefix("grid/"): v for k, v in last.items() if k.startswith("grid/accuracy/")}
    size = max(int(n) for k in pairs for n in k.removeprefix("accuracy/").split("x"))
    return accuracy_grid(pairs, size)


def reading(add_data: dict, key_data: dict) -> str:
    averages = {s: float(np.mean(d["grid_average"])) for s, d in add_data.items()}
    order = sorted(averages, key=averages.get, reverse=True)
    text = (
        "Addition grid average, highest first: "
        + ", ".join(f"`{s}` {100 * averages[s]:.1f} %" for s in order)
        + " (paper: TAPE 32.8 > FIRE 27.0 > RandPE 26.6 > RoPE 26.3 > NoPE 22.5). "
    )
    if "tape" in averages and "rope" in averages:
        text += (
            "TAPE is ahead of RoPE as in the paper, but both models get almost no sums right "
            "after 300 steps, so the gap is not evidence either way. "
            if averages["tape"] > averages["rope"]
            else "Unlike the paper, TAPE is not ahead of RoPE: 300 steps of a 2-layer model "
            "are far from the paper's 20k steps of a 16-layer one, and TAPE's extra "
            "position-tensor parameters may need longer to pay off. "
        )
    longest = {s: float(np.mean(list(d.values())[-1])) for s, d in key_data.items()}
    finite = {s: v for s, v in longest.items() if not math.isnan(v)}
    text += (
        "Passkey accuracy at the longest length: "
        + ", ".join(f"`{s}` {100 * v:.1f} %" for s, v in finite.items())
        + "; the paper's TAPE is near 100 % to 8k, after fine-tuning a 7B model rather than "
        "200 steps from scratch."
    )
    return text


if __name__ == "__main__":
    main()

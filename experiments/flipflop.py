"""Study 1: Flip-Flop error in distribution, OOD sparse and OOD dense, and error against
steps (CoPE Table 2 left, Table 7, Figure 5; Golovneva et al. 2024, arXiv 2405.18719; task of
Liu et al. 2023, arXiv 2306.00946).

    python -m experiments.flipflop --scale=cpu      # writes experiments/results/flipflop.md
    python -m experiments.flipflop --scale=paper    # the paper's setting, for accelerators
"""

from __future__ import annotations

from collections.abc import Sequence

from experiments import sweep, sweep_page, sweep_plots

STUDY = "flipflop"
CONFIG = "configs/flipflop.py"
# CoPE Table 2 (left) with Table 7's standard deviations: error in %, 10k steps, D=256, 4/4.
# The paper has one OOD set (more ignore instructions, i.e. our ood_sparse).
PAPER = {
    "learned": {"test": 6.8, "test_std": 6.9, "ood_sparse": 21.7, "ood_sparse_std": 7.9},
    "rope": {"test": 1.8, "test_std": 3.1, "ood_sparse": 20.3, "ood_sparse_std": 2.9},
    "cope": {"test": 0.0, "test_std": 0.06, "ood_sparse": 4.9, "ood_sparse_std": 4.4},
}
# PaTH (Yang et al. 2025, arXiv 2505.16381) Table 1: FFLM error in % (in distribution, OOD
# sparse = 98 % ignores, OOD dense = 10 % ignores, our p_i of the same splits), 1 layer, 2 heads,
# 64 dimensions; no standard deviations, steps or sequence length in the retrieved text.
PATH_PAPER = {
    "rope": (6.9, 40.3, 0.01),
    "stickbreaking": (9.6, 38.9, 0.0),
    "fox": (8.3, 36.3, 0.0),
    "path": (0.0, 0.0001, 0.0),
}
SCHEMES = {
    "smoke": ("cope",),
    "cpu": ("learned", "rope", "cope", *sweep.CONTEXTUAL_SINCE_COPE),
    "paper": (
        "learned",
        "rope",
        "nope",
        "alibi",
        "cope",
        "fox",
        "stickbreaking",
        "tape",
        *sweep.CONTEXTUAL_SINCE_COPE,
    ),
}
SEEDS = {"smoke": 1, "cpu": 5, "paper": 5}
# Split -> its column header.
SPLITS = {
    "test": "test error %",
    "ood_sparse": "OOD sparse %",
    "ood_dense": "OOD dense %",
    "long_test": "4x length %",
    "long_sparse": "4x length sparse %",
}
SCALE_NOTES = {
    "smoke": "Smoke scale: 20 steps of a tiny model on 31-token sequences; checks the "
    "pipeline only, the numbers mean nothing.",
    "cpu": """The `cpu` scale differs from the paper: 2 layers, 4 heads, D = 64 (paper 4/4, 256),
1,200 steps of batch 32 at lr 3e-3 with linear decay (paper 10,000 steps of batch 16 at 3e-4; the
README's demo runs 600), and sequences of 32 instructions (63 tokens; paper 256 instructions, 511
tokens), evaluated on 256 sequences per split (paper 1,000). At 63 tokens even the OOD-sparse reads
sit at distances the training set covers, so the paper's OOD contrast has little room to show. The
two `4x length` columns are copejax's addition: the same model evaluated on 128 instructions (255
tokens; p_i = 0.8 and the sparse 0.98), positions and write-read distances it never trained on. The
learned table has 255 rows so that it can run them; rows past 63 are never trained.""",
    "paper": """The `paper` scale is the CoPE paper's setting (4 layers, 4 heads, D = 256, 10,000
steps, batch 16, lr 3e-4 with linear decay, 256 instructions; the 4x length splits have 1,024);
meant for an accelerator.""",
}


# A run learned the task when its in-distribution error is below this (the page and the demo).
LEARNED_ERROR = 0.01

# The study trains twice as long as the demo (configs/flipflop.py:cpu, 600 steps), where CoPE
# learned the task in one seed of three.
ARGS = {"smoke": "smoke", "cpu": "cpu,steps=1200", "paper": "paper"}


def arms(scale: str) -> list[sweep.Arm]:
    return [sweep.Arm(s, CONFIG, f"{ARGS[scale]},position={s}") for s in SCHEMES[scale]]


def main(argv: Sequence[str] | None = None) -> None:
    args = sweep.parse_args(argv, STUDY)
    result = sweep.run_sweep(
        STUDY, args.scale, arms(args.scale), sweep.seeds_for(args, SEEDS[args.scale]),
        args.workroot, jobs=args.jobs,
    )  # fmt: skip
    labels = list(result.records)
    splits = [s for s in SPLITS if result.final(labels[0], f"{s}/error")]
    summary = {
        label: {split: sweep.mean_std(result.final(label, f"{split}/error")) for split in splits}
        for label in labels
    }
    rows = []
    for label in labels:
        cells = [sweep.percent(summary[label][s], digits=2) for s in splits]
        paper = PAPER.get(label, {})
        rows.append(
            [
                label,
                *cells,
                _paper(paper, "test"),
                _paper(paper, "ood_sparse"),
                " / ".join(f"{v:g}" for v in PATH_PAPER[label]) if label in PATH_PAPER else "-",
            ]
        )
    headers = [SPLITS[s] for s in splits]
    table = sweep.markdown_table(
        ["scheme", *headers, "CoPE paper in-dist %", "CoPE paper OOD %", PATH_COLUMN], rows
    )
    bars = sweep_plots.plot_path(args.out, STUDY, args.scale, "errors")
    sweep_plots.bar_plot(
        labels,
        {s: [summary[label][s] for label in labels] for s in splits},
        bars,
        ylabel="error (fraction of reads)",
        title="Flip-Flop error, mean ± std over seeds",
        paper={
            "test": [_fraction(PAPER.get(label, {}).get("test")) for label in labels],
            "ood_sparse": [_fraction(PAPER.get(label, {}).get("ood_sparse")) for label in labels],
        },
    )
    curves = sweep_plots.plot_path(args.out, STUDY, args.scale, "error_vs_steps")
    sweep_plots.curve_plot(
        {
            f"{label} {split}": [
                sweep.eval_curve(r, f"{split}/error") for r in result.records[label]
            ]
            for label in labels
            for split in ("test", "ood_sparse", "long_sparse")
            if split in splits
        },
        curves,
        xlabel="step",
        ylabel="error",
        title="Flip-Flop error against steps (CoPE Fig. 5)",
    )
    page = "\n".join(
        [
            sweep_page.header(
                "Study 1: Flip-Flop (CoPE Table 2 left, Table 7, Figure 5)",
                args.scale,
                result,
                SCALE_NOTES[args.scale],
            ),
            "Error = wrong reads / reads (%), last evaluation, mean ± std over seeds. CoPE "
            "paper columns: CoPE Table 2 with Table 7's std in brackets (its single OOD set is "
            f"the sparse one). {PATH_COLUMN}: PaTH Table 1 (arXiv 2505.16381), in distribution "
            "/ OOD sparse / OOD dense, the same three splits with 1 layer, 2 heads and 64 "
            "dimensions (no std given; its PaTH-FoX has no Flip-Flop numbers). The 4x length "
            "columns have no paper counterpart.",
            "",
            table,
            "",
            f"Every seed's error % (seeds {', '.join(map(str, result.seeds))}, in that order):",
            "",
            sweep.per_seed_table(result, {f"{s}/error": SPLITS[s] for s in splits}, digits=2),
            "",
            f"![errors]({bars.name})",
            "",
            f"![error against steps]({curves.name})",
            "",
            "## Reading",
            "",
            reading(summary, learned_task(result, labels)),
            "",
            since_cope_reading(result, labels),
            "",
            "## Commands",
            "",
            sweep_page.commands_block(STUDY, args, result),
        ]
    )
    path = sweep_page.write_outputs(
        args.out,
        STUDY,
        args.scale,
        page,
        result,
        metric="error (fraction)",
        results={
            label: {
                s: sweep.spread(*summary[label][s], result.final(label, f"{s}/error"))
                for s in splits
            }
            for label in labels
        },
        paper_percent=PAPER,
    )
    print(table)
    print(f"wrote {path}")


PATH_COLUMN = "PaTH paper ID / sparse / dense %"


def since_cope_reading(result: sweep.Sweep, labels: list[str]) -> str:
    """The schemes since CoPE against RoPE and CoPE, seed by seed, and PaTH's own claim."""
    lines = []
    for split, name in (("ood_sparse", "OOD sparse"), ("long_sparse", "4x length sparse")):
        per_seed = {label: result.final(label, f"{split}/error") for label in labels}
        arms = [s for s in sweep.CONTEXTUAL_SINCE_COPE if per_seed.get(s)]
        for base in ("rope", "cope"):
            if per_seed.get(base) and arms:
                lines.append(
                    f"{name}, the schemes since CoPE against `{base}`: "
                    + "; ".join(sweep.seed_comparison(s, base, per_seed, "") for s in arms)
                    + "."
                )
    if "path" in labels and "rope" in labels:
        path, rope = (
            {s: result.final(label, f"{s}/error") for s in ("test", "ood_sparse", "ood_dense")}
            for label in ("path", "rope")
        )
        below = [SPLITS[s] for s in path if max(path[s]) < min(rope[s])]
        lines.append(
            "The PaTH paper has PaTH solve all three splits (at most 0.0001 %) while RoPE "
            "errs 6.9 % in distribution and 40.3 % on OOD sparse. Here PaTH's error is below "
            "RoPE's on every seed on "
            + (", ".join(below) if below else "none of the three splits")
            + (
                "; at this length RoPE already solves the in-distribution and OOD splits, so "
                "the paper's gap has no room to show there."
                if max(rope["ood_sparse"]) < 0.01
                else "."
            )
        )
    return " ".join(lines)


def _paper(paper: dict[str, float], key: str) -> str:
    if key not in paper:
        return "-"
    return f"{paper[key]:g} ({paper[key + '_std']:g})"


def _fraction(value: float | None) -> float | None:
    return None if value is None else value / 100.0


def learned_task(result: sweep.Sweep, labels: list[str]) -> dict[str, tuple[int, int]]:
    """Per scheme: (seeds whose in-distribution error is below 1 %, seeds)."""
    out = {}
    for label in labels:
        errors = result.final(label, "test/error")
        out[label] = (sum(e < LEARNED_ERROR for e in errors), len(errors))
    return out


def reading(
    summary: dict[str, dict[str, tuple[float, float]]],
    learned: dict[str, tuple[int, int]] | None = None,
) -> str:
    """Sentences comparing the measured ranking with the paper's, written from the numbers."""
    lines = []
    if learned:
        lines.append(
            f"Seeds that learned the task (in-distribution error below {100 * LEARNED_ERROR:g} %): "
            + ", ".join(f"`{k}` {n}/{total}" for k, (n, total) in learned.items())
            + "."
        )
    for split, name in (("ood_sparse", "OOD-sparse"), ("long_sparse", "4x-length sparse")):
        errors = {label: v[split][0] for label, v in summary.items() if split in v}
        if not errors:
            continue
        ranked = sorted(errors.items(), key=lambda kv: kv[1])
        lines.append(
            f"{name} error, lowest first: "
            + ", ".join(f"`{k}` {100 * v:.2f} %" for k, v in ranked)
            + "."
        )
    ood = {label: v["ood_sparse"][0] for label, v in summary.items()}
    if "cope" in ood and "rope" in ood:
        if ood["cope"] < ood["rope"]:
            lines.append("As in the paper, CoPE's OOD-sparse error is below RoPE's.")
        else:
            lines.append(
                "Unlike the paper, CoPE's OOD-sparse error is not below RoPE's: at 63 tokens "
                "the last write is close enough that RoPE's token distances still locate it."
            )
    long = {label: v["long_sparse"][0] for label, v in summary.items() if "long_sparse" in v}
    if "cope" in long and len(long) > 1:
        others = [k for k in long if k != "cope"]
        if all(long["cope"] < long[k] for k in others):
            lines.append(
                "At 4x the training length CoPE has the lowest error: it locates the last "
                "write by counting writes, which does not depend on how far back it is, while "
                "token positions and distances past training were never seen."
            )
        else:
            best = min(long, key=long.get)
            lines.append(f"At 4x the training length `{best}`, not CoPE, has the lowest error.")
    return " ".join(lines)


if __name__ == "__main__":
    main()

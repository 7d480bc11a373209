"""Study 7: attention layouts of current models against length: RoPE, NoPE, a SWAN-style
sliding-window RoPE + NoPE hybrid, RoPE with a learned sink, SSMax-scaled RoPE, CoPE and FoX.

    python -m experiments.hybrids --scale=cpu     # experiments/results/hybrids.md

Every arm is the ``lm`` task (``configs/lm.py``) with the same model, steps and seeds, trained
at length T and evaluated on the validation text packed at T, 2T, 4T and 8T
(``copejax.evaluation.lm_eval.evaluate_lengths``): perplexity by length and loss by position bucket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import sweep, sweep_page
from experiments.lm import extrapolate, length_plots, perplexity_cells, ppl_by_length

STUDY = "hybrids"
CONFIG = "configs/lm.py"
# label -> the arm's config arguments beyond the scale's (copejax.config.base shortcuts).
ARMS = {
    "rope": "position=rope",
    "nope": "position=nope",
    "swa-rope + nope (3:1)": "position=rope,layout=swan,window={window}",
    "rope + sink": "position=rope,attention_sink=true",
    "rope + ssmax": "position=rope,logit_scaling=ssmax",
    "cope": "position=cope",
    "fox": "position=fox",
}
SCALE_ARGS = {
    "smoke": "smoke,steps=10,layers=4",
    "cpu": "cpu,length=64,d_model=64,steps=150,layers=4",
    "paper": "paper,layers=12",
}
WINDOW = {"smoke": 16, "cpu": 16, "paper": 256}  # the local window: T / 4
SEEDS = {"smoke": 1, "cpu": 3, "paper": 3}
EVAL_ROWS = {"smoke": 4, "cpu": 32, "paper": 0}  # rows per extrapolation split (0 = all)
# Arms whose paper claims better length generalisation than a RoPE-like baseline, so that the
# comparison with rope tests the claim; the others are compared with rope for information.
CLAIM_AGAINST_ROPE = ("swa-rope + nope (3:1)", "rope + ssmax", "fox")
# What each paper says about length, from its abstract (the only part retrievable offline;
# no table numbers are quoted).
CLAIMS = {
    "swa-rope + nope (3:1)": "SWAN-GPT (arXiv 2504.08719): interleaving NoPE layers with "
    "sliding-window RoPE layers 'robustly generalizes to sequence lengths substantially "
    "longer than those seen during training', without long-context training (with a "
    "dynamic scaling of attention scores at inference, not used here).",
    "rope + ssmax": "SSMax (arXiv 2501.19399): models with SSMax 'significantly improve "
    "performance in long contexts' and have better length generalization.",
    "rope + sink": "GPT-OSS's learned sink logit makes no length claim; StreamingLLM "
    "(arXiv 2309.17453) attributes unstable long-context behaviour of window attention "
    "to the missing sink.",
    "fox": "FoX (arXiv 2503.02130): 'outperforms the Transformer on ... length "
    "extrapolation' and needs no position embedding.",
    "cope": "CoPE (arXiv 2405.18719, Fig. 3): CoPE extrapolates better than absolute and "
    "relative PE in language modelling.",
    "rope": "Reference arm: RoPE is known to degrade past its training length.",
    "nope": "NoPE (arXiv 2203.16634): decoder-only models learn positions without an "
    "encoding; no extrapolation claim is made there.",
}
NOTES = {
    "smoke": "Smoke scale: 10 steps of a 4-layer tiny model; checks the pipeline only.",
    "cpu": """The `cpu` scale: Shakespeare bytes (the bundled corpus), T = 64, D = 64, 4 layers
(so that the 3:1 pattern fits), 4 heads, 150 steps of 16 rows, 3 seeds; evaluation at 64, 128,
256 and 512 tokens on the first 32 rows of each split. The hybrid is copejax's `swan` preset
(one full NoPE layer, then three sliding-window RoPE layers, as SWAN-GPT orders them) with a
window of 16 = T / 4 (SWAN-GPT's window is 512 at far larger T). The sink is the GPT-OSS
learned per-head logit (`model.attention_sink`); SSMax scales each query by s log n with a
learned s per head (`model.logit_scaling=ssmax`). Perplexities are per byte.""",
    "paper": """The `paper` scale is the lm config's paper setting with 12 layers; meant for
accelerators and not run here.""",
}


def arms_for(scale: str) -> list[sweep.Arm]:
    return [
        sweep.Arm(label, CONFIG, f"{SCALE_ARGS[scale]},{args.format(window=WINDOW[scale])}")
        for label, args in ARMS.items()
    ]


def main(argv: Sequence[str] | None = None) -> None:
    args = sweep.parse_args(argv, STUDY)
    result = sweep.run_sweep(
        STUDY,
        args.scale,
        arms_for(args.scale),
        sweep.seeds_for(args, SEEDS[args.scale]),
        args.workroot,
        jobs=args.jobs,
    )
    per_run = {
        label: [extrapolate(w, EVAL_ROWS[args.scale]) for w in result.workdirs[label]]
        for label in result.records
    }
    write(args, result, per_run)


def bucket_losses(runs: Sequence[Mapping[str, Any]], split: str) -> dict[str, list[float]]:
    """bucket -> each seed's loss in that position bucket of ``split``."""
    out: dict[str, list[float]] = {}
    for run in runs:
        for bucket, loss in run.get(split, {}).get("buckets", {}).items():
            out.setdefault(bucket, []).append(float(loss))
    return out


def write(
    args: Any, result: sweep.Sweep, per_run: Mapping[str, Sequence[Mapping[str, Any]]]
) -> Path:

    ppl = {label: [ppl_by_length(r) for r in runs] for label, runs in per_run.items()}
    lengths = sorted({n for runs in ppl.values() for r in runs for n in r})
    train_length = lengths[0]
    stats = {
        label: {n: sweep.mean_std([r[n] for r in runs]) for n in lengths}
        for label, runs in ppl.items()
    }
    table = sweep.markdown_table(
        ["arm", *(f"ppl at {n} ({n // train_length}T)" for n in lengths)],
        [[label, *(_cell(stats[label][n]) for n in lengths)] for label in ppl],
    )
    longest_split = max(
        (name for runs in per_run.values() for r in runs for name in r),
        key=lambda name: next(r[name]["length"] for runs in per_run.values() for r in runs),
    )
    buckets = {label: bucket_losses(runs, longest_split) for label, runs in per_run.items()}
    bucket_names = list(next(iter(buckets.values())))
    bucket_table = sweep.markdown_table(
        ["arm", *bucket_names],
        [
            [label, *(_cell(sweep.mean_std(b.get(name, [math.nan]))) for name in bucket_names)]
            for label, b in buckets.items()
        ],
    )
    curve, first_seed = length_plots(
        args,
        STUDY,
        per_run,
        ppl,
        f"Attention layouts against length, trained at T = {train_length}",
    )
    claims = sweep.markdown_table(
        ["arm", "the paper's claim (abstract)", "here"],
        [[label, CLAIMS[label], verdict(label, stats, ppl, lengths)] for label in ppl],
    )
    page = "\n".join(
        [
            sweep_page.header(
                "Study 7: attention layouts against length (hybrids, sinks, SSMax)",
                args.scale,
                result,
                NOTES[args.scale],
            ),
            "Validation perplexity of the last checkpoint at the training length T and at "
            "2T, 4T and 8T, mean ± std over seeds.",
            "",
            table,
            "",
            f"![perplexity against length]({curve.name})",
            "",
            f"Loss by position bucket at {longest_split} (mean ± std over seeds; the first "
            f"bucket lies inside the training length, the rest past it):",
            "",
            bucket_table,
            "",
            f"![seed 0: perplexity and loss per position bucket]({first_seed.name})",
            "",
            "## The papers' claims beside these numbers",
            "",
            "'Here' compares the arm's perplexity at the longest length with RoPE's (better or "
            "worse only beyond both arms' seed spread), and its change from T to the longest "
            "length (ratio) with RoPE's. Perplexity falls with length for every arm, since each "
            "split is whole documents packed at that length and later tokens see more context; "
            "at this size (bytes, T = 64, 150 steps) no arm breaks down past T, RoPE included, "
            "so the comparison is between arms that all extrapolate, not a test of failure. "
            "The CoPE paper's claim is against absolute and relative PE (study 4), not RoPE.",
            "",
            claims,
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
        train_length=train_length,
        perplexity=perplexity_cells(stats, ppl),
        buckets={
            label: {k: sweep.spread(*sweep.mean_std(v), v) for k, v in b.items()}
            for label, b in buckets.items()
        },
        claims=CLAIMS,
    )
    print(table)
    print(f"wrote {path}")
    return path


def verdict(
    label: str,
    stats: Mapping[str, Mapping[int, tuple[float, float]]],
    ppl: Mapping[str, Sequence[Mapping[int, float]]],
    lengths: list[int],
) -> str:
    """Whether the arm extrapolates better than RoPE here: lower perplexity at the longest
    length, by more than both arms' seed spread (and whether every seed of the arm is below
    every seed of rope), and its growth from T."""
    first, last = lengths[0], lengths[-1]
    mean, std = stats[label][last]
    growth = mean / stats[label][first][0]
    if label == "rope" or "rope" not in stats:
        return f"ppl {mean:.3f} at {last // first}T, x{growth:.2f} from T"
    rope_mean, rope_std = stats["rope"][last]
    rope_growth = rope_mean / stats["rope"][first][0]
    if math.isnan(mean):
        return "does not run at this length"
    if mean < rope_mean - (std + rope_std):
        word = "better than rope"
    elif mean > rope_mean + (std + rope_std):
        word = "worse than rope"
    else:
        word = "no difference from rope beyond the seed spread"
    if label in CLAIM_AGAINST_ROPE:
        prefix = {"better than rope": "agrees: ", "worse than rope": "disagrees: "}
        lead = prefix.get(word, "does not show the claim: ")
    else:
        lead = "(no claim against rope to test) "
    seeds = [r[last] for r in ppl[label]]
    rope_seeds = [r[last] for r in ppl["rope"]]
    if max(seeds) < min(rope_seeds) or min(seeds) > max(rope_seeds):
        word += f" on every seed ({len(seeds)} of {len(seeds)})"
    word = lead + word
    return (
        f"{word} at {last // first}T ({mean:.3f} vs {rope_mean:.3f}); growth from T "
        f"x{growth:.2f} vs rope's x{rope_growth:.2f}"
    )


def _cell(pair: tuple[float, float]) -> str:
    mean, std = pair
    return "n/a" if math.isnan(mean) else f"{mean:.3f} ± {std:.3f}"


if __name__ == "__main__":
    main()

"""Study 8: extending a pretrained RoPE model's context from T to 4T: PI, NTK, YaRN (both ramps),
Llama 3 scaling and the TAPE retrofit, each with the same short fine-tune.

    python -m experiments.context_extension --scale=cpu   # experiments/results/context_extension.md

No downloads: the pretrained model is a small Llama trained here by copejax on the embedded
corpus (``configs/lm.py``, the ``lm`` task) at T, then exported to the Hugging Face format and
converted back (``python -m copejax.interop.convert --to_hf``, then ``--from_hf``): the path a
user's
checkpoint takes. Each arm fine-tunes that checkpoint at 4T (``configs/lm.py:init_from=...``)
with its scheme; every arm, the unchanged pretrained model included, is then evaluated on the
validation text packed at T, 2T, 4T and 8T (``copejax.evaluation.lm_eval``): perplexity by length
and
loss by position. Methods: PI (Chen et al. 2023, arXiv 2306.15595), NTK-aware scaling
(r/LocalLLaMA 2023), YaRN (Peng et al. 2023, arXiv 2309.00071; the paper's wavelength ramp and
HF's index ramp), Llama 3.1's scaling, TAPE's retrofit (Zhu et al. 2025, arXiv 2501.00712,
section 3.3).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments import sweep, sweep_page
from experiments.lm import length_plots, perplexity_cells, ppl_by_length

STUDY = "context_extension"
CONFIG = "configs/lm.py"
FACTOR = 4
# label -> the fine-tune's scheme (configs/lm.py arguments after init_from).
ARMS = {
    "rope, no rescaling": "position=rope",
    "PI (linear)": f"position=rope,scaling=linear,factor={FACTOR}",
    "NTK": f"position=rope,scaling=ntk,factor={FACTOR}",
    "YaRN, paper ramp": f"position=rope,scaling=yarn,factor={FACTOR}",
    "YaRN, HF index ramp": f"position=rope,scaling=yarn,factor={FACTOR},yarn_ramp=index",
    "Llama 3": f"position=rope,scaling=llama3,factor={FACTOR}",
    "TAPE retrofit": "position=tape",
}
PRETRAIN = {
    "smoke": "smoke,steps=10",
    "cpu": "cpu,length=64,d_model=64,steps=300",
    "paper": "paper",
}
FINETUNE = {  # at FACTOR * T
    "smoke": "smoke,steps=4,length=128",
    "cpu": "cpu,length=256,steps=40,batch_size=8,lr=1e-3,warmup_steps=4",
    "paper": f"paper,length={FACTOR * 1024},steps=1000,lr=2e-5",
}
SEEDS = {"smoke": 1, "cpu": 3, "paper": 3}  # of the fine-tunes: one pretrained model
EVAL_ROWS = {"smoke": 4, "cpu": 32, "paper": 0}
# Claims quoted from retrieved text only (the abstracts; TAPE's setup as quoted by
# acmrep2026.k117.org); the papers' tables were not retrievable offline.
CLAIMS = (
    "YaRN (arXiv 2309.00071, abstract): 'a compute-efficient method to extend the context "
    "window ..., requiring 10x less tokens and 2.5x less training steps than previous "
    "methods', and 'YaRN exhibits the capability to extrapolate beyond the limited context "
    "of a fine-tuning dataset'. Its perplexity tables (Llama 2 at 8k-128k) were not "
    "retrievable, so no number is quoted.",
    "TAPE (arXiv 2501.00712, abstract): 'can be easily integrated into pre-trained "
    "transformers, offering parameter-efficient fine-tuning with minimal overhead'; its "
    "experiment extends Llama 2 7B from 4096 to 8192 tokens and compares perplexity at 8192 "
    "on proof-pile and PG19. Its numbers were not retrievable.",
)
NOTES = {
    "smoke": "Smoke scale: a tiny model, 10 pretraining and 4 fine-tuning steps; checks the "
    "pipeline only.",
    "cpu": f"""The `cpu` scale: Shakespeare bytes (the bundled corpus), a 2-layer llama-block
model with D = 64, 4 heads, pretrained with RoPE (base 10000) at T = 64 for 300 steps of 16
rows; each arm then fine-tunes all parameters for 40 steps of 8 rows at {FACTOR}T = 256 (lr
1e-3, 4 warmup steps, cosine decay), 3 seeds (the fine-tune's data order and new parameters;
the pretrained model is one, seed 0). Evaluation at 64, 128, 256 and 512 tokens on the
first 32 rows of each split; perplexities are per byte. The papers fine-tune 7B models on
billions of tokens: only the direction of the comparisons can carry over. The TAPE retrofit
trains every parameter here (the paper's PEFT variant trains only TAPE's).""",
    "paper": f"""The `paper` scale documents a Llama-sized setting (configs/lm.py paper,
T = 1024, fine-tune at {FACTOR}T); meant for accelerators and not run here.""",
}


def prepare(scale: str, workroot: str | Path) -> tuple[sweep.Sweep, Path, list[str]]:
    """Pretrains the rope model, then exports it to HF and converts it back (skipped when the
    converted checkpoint exists). Returns the pretraining sweep, the converted checkpoint and
    the conversion commands."""
    from copejax.interop import convert

    arm = sweep.Arm("pretrained rope (no fine-tune)", CONFIG, f"{PRETRAIN[scale]},position=rope")
    pretraining = sweep.run_sweep(STUDY, scale, [arm], [0], workroot)
    workdir = pretraining.workdirs[arm.label][0]
    hf_dir, converted = workdir.parent / "pretrained_hf", workdir.parent / "pretrained_converted"
    commands = [
        f"python -m copejax.interop.convert --to_hf={workdir} --out={hf_dir}",
        f"python -m copejax.interop.convert --from_hf={hf_dir} --out={converted}",
    ]
    if not (converted / "model.json").exists():
        if not (hf_dir / "config.json").exists():
            convert.to_hf(workdir, hf_dir)
        convert.from_hf(hf_dir, converted)
    return pretraining, converted, commands


def evaluate(workdir: Path, task: Any, max_examples: int) -> dict[str, dict[str, Any]]:
    """Perplexity at the pretraining T, 2T, 4T, 8T (``task``'s splits), cached in the workdir."""
    cache = workdir / f"extrapolation_T{task.seq_len}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    from copejax.evaluation import lm_eval
    from copejax.training.trained_run import load_run

    run = load_run(workdir)
    results = lm_eval.evaluate_lengths(
        run.model_config, run.params, task, batch_size=8, max_examples=max_examples
    )
    cache.write_text(json.dumps(results) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> None:
    from copejax.training.trained_run import load_run

    args = sweep.parse_args(argv, STUDY)
    pretraining, converted, convert_commands = prepare(args.scale, args.workroot)
    arms = [
        sweep.Arm(label, CONFIG, f"{FINETUNE[args.scale]},init_from={converted},{scheme}")
        for label, scheme in ARMS.items()
    ]
    finetunes = sweep.run_sweep(
        STUDY,
        args.scale,
        arms,
        sweep.seeds_for(args, SEEDS[args.scale]),
        args.workroot,
        jobs=args.jobs,
    )
    result = _joined(pretraining, finetunes, convert_commands)
    task = load_run(pretraining.workdirs[next(iter(pretraining.workdirs))][0]).task
    per_run = {
        label: [evaluate(w, task, EVAL_ROWS[args.scale]) for w in workdirs]
        for label, workdirs in result.workdirs.items()
    }
    write(args, result, per_run, task.seq_len)


def _joined(first: sweep.Sweep, second: sweep.Sweep, between: list[str]) -> sweep.Sweep:
    """One Sweep of the pretraining, the conversion commands and the fine-tunes."""
    return dataclasses.replace(
        second,
        records={**first.records, **second.records},
        commands=[*first.commands, *between, *second.commands],
        wall_time_s=first.wall_time_s + second.wall_time_s,
        workdirs={**first.workdirs, **second.workdirs},
        reused=first.reused + second.reused,
        load_average=(first.load_average[0], second.load_average[1]),
    )


def write(
    args: Any,
    result: sweep.Sweep,
    per_run: Mapping[str, Sequence[Mapping[str, Any]]],
    train_length: int,
) -> Path:
    ppl = {label: [ppl_by_length(r) for r in runs] for label, runs in per_run.items()}
    lengths = sorted({n for runs in ppl.values() for r in runs for n in r})
    stats = {
        label: {n: sweep.mean_std([r[n] for r in runs]) for n in lengths}
        for label, runs in ppl.items()
    }
    table = sweep.markdown_table(
        ["arm", *(f"ppl at {n} ({n // train_length}T)" for n in lengths)],
        [[label, *(_cell(stats[label][n]) for n in lengths)] for label in ppl],
    )
    curve, first_seed = length_plots(
        args,
        STUDY,
        per_run,
        ppl,
        f"Context extension T = {train_length} -> {FACTOR}T: perplexity by length",
    )
    page = "\n".join(
        [
            sweep_page.header(
                f"Study 8: context extension of a pretrained RoPE model, T -> {FACTOR}T",
                args.scale,
                result,
                NOTES[args.scale],
            ),
            "Validation perplexity at the pretraining length T and at 2T, 4T, 8T (mean ± std "
            "over the fine-tune seeds; one pretrained model). Fine-tuned arms saw sequences of "
            f"{FACTOR}T; 8T is past every fine-tune.",
            "",
            table,
            "",
            f"![perplexity against length]({curve.name})",
            "",
            f"![seed 0: perplexity and loss per position bucket]({first_seed.name})",
            "",
            "## The papers' claims",
            "",
            *(f"- {claim}" for claim in CLAIMS),
            "",
            "## Reading",
            "",
            reading(stats, ppl, lengths),
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
        factor=FACTOR,
        perplexity=perplexity_cells(stats, ppl),
        claims=list(CLAIMS),
    )
    print(table)
    print(f"wrote {path}")
    return path


def _cell(pair: tuple[float, float]) -> str:
    mean, std = pair
    return "n/a" if math.isnan(mean) else f"{mean:.3f} ± {std:.3f}"


def _versus(per_seed: Mapping[str, Sequence[float]], mine: str, theirs: str) -> str:
    """'below on every seed', 'above on every seed' or 'the seeds overlap'."""
    a, b = per_seed[mine], per_seed[theirs]
    if max(a) < min(b):
        return "below on every seed"
    if min(a) > max(b):
        return "above on every seed"
    return "the seeds overlap"


def reading(
    stats: Mapping[str, Mapping[int, tuple[float, float]]],
    ppl: Mapping[str, Sequence[Mapping[int, float]]],
    lengths: list[int],
) -> str:
    """What the table says, written from its numbers (each comparison says whether every seed
    agrees)."""
    at = lambda label, n: stats[label][n][0]
    seeds_at = lambda n: {label: [r[n] for r in runs] for label, runs in ppl.items()}
    base = next(iter(stats))  # the pretrained model
    target, longest = lengths[0] * FACTOR, lengths[-1]
    if target not in lengths:
        return "The evaluation lengths do not include the fine-tune length; no reading."
    tuned = [label for label in stats if label != base]
    order = sorted(tuned, key=lambda label: at(label, target))
    parts = [
        f"At {FACTOR}T ({target} tokens) the pretrained model has perplexity "
        f"{at(base, target):.3f}; the fine-tunes (mean over seeds) rank "
        + ", ".join(f"`{label}` {at(label, target):.3f}" for label in order)
        + "."
    ]
    past = sorted(tuned, key=lambda label: at(label, longest))
    parts.append(
        f"At {longest // lengths[0]}T, past every fine-tune: "
        + ", ".join(f"`{label}` {at(label, longest):.3f}" for label in past)
        + "."
    )
    yarn = [label for label in tuned if label.startswith("YaRN")]
    others = [label for label in tuned if not label.startswith("YaRN")]
    if yarn and others:
        best_yarn = min(yarn, key=lambda label: at(label, longest))
        best_other = min(others, key=lambda label: at(label, longest))
        relation = _versus(seeds_at(longest), best_yarn, best_other)
        parts.append(
            "YaRN's claim to extrapolate beyond its fine-tuning length, read as a ranking at "
            f"{longest // lengths[0]}T: the best YaRN arm, `{best_yarn}`, against the best "
            f"other arm, `{best_other}`: {at(best_yarn, longest):.3f} vs "
            f"{at(best_other, longest):.3f} ({relation})."
        )
    if "TAPE retrofit" in stats and "rope, no rescaling" in stats:
        tape, rope = at("TAPE retrofit", target), at("rope, no rescaling", target)
        relation = _versus(seeds_at(target), "TAPE retrofit", "rope, no rescaling")
        parts.append(
            f"The TAPE retrofit reaches {tape:.4f} at {FACTOR}T against {rope:.4f} for the "
            f"same fine-tune of plain RoPE ({relation}): starting from W2 = 0, TAPE's "
            "contribution grows only as fast as the optimiser moves W2, so a short fine-tune "
            "leaves it close to the RoPE model it started as."
        )
    return " ".join(parts)


if __name__ == "__main__":
    main()

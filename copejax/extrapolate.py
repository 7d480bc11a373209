"""Length extrapolation of trained LM runs (CoPE Figure 3, arXiv 2405.18719): perplexity at
T, 2T, 4T, 8T and loss per position bucket, from each workdir's latest checkpoint.

    python -m copejax.extrapolate --workdir=workdirs/lm_rope [--workdir=workdirs/lm_cope ...] \
        [--out=workdirs/extrapolation] [--batch_size=8] [--max_examples=0] [--bucket_width=64]

Writes ``extrapolation.json`` and ``extrapolation.png`` into every workdir and, with ``--out``,
``<out>.json`` and ``<out>.png`` comparing the runs (one line per position scheme).
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import app, flags


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from copejax import lm_eval
    from copejax.data.lm import LanguageModel
    from copejax.trained_run import load_run

    runs, train_length = {}, 0
    for path in flags.FLAGS.workdir:
        run = load_run(path, flags.FLAGS.step)
        if not isinstance(run.task, LanguageModel):
            raise app.UsageError(f"{path} trained task {run.task.name!r}, not 'lm'")
        results = lm_eval.evaluate_lengths(
            run.model_config, run.params, run.task, batch_size=flags.FLAGS.batch_size,
            max_examples=flags.FLAGS.max_examples, bucket_width=flags.FLAGS.bucket_width,
        )  # fmt: skip
        record = {"workdir": str(path), "step": run.step, "position": run.label, "splits": results}
        (Path(path) / "extrapolation.json").write_text(json.dumps(record, indent=2) + "\n")
        train_length = run.task.seq_len
        label = run.label if run.label not in runs else f"{run.label} ({path})"
        runs[label] = results
        lm_eval.plot_extrapolation(
            {label: results}, train_length, str(Path(path) / "extrapolation.png")
        )
        for split, r in results.items():
            shown = f"ppl {r['perplexity']:.3f}" if "error" not in r else r["error"]
            print(f"{label} {split} (length {r['length']}): {shown}", flush=True)
    if flags.FLAGS.out:
        out = Path(flags.FLAGS.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(runs, indent=2) + "\n")
        lm_eval.plot_extrapolation(runs, train_length, str(out.with_suffix(".png")))


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so that importing this
    module next to other tools defines no clashing flags)."""
    flags.DEFINE_multi_string("workdir", None, "Workdir(s) of lm training runs.")
    flags.DEFINE_string("out", None, "Path prefix of the comparison (.json and .png).")
    flags.DEFINE_integer("batch_size", 8, "Rows per batch at the training length.")
    flags.DEFINE_integer("max_examples", 0, "Rows per split (0 = all).")
    flags.DEFINE_integer("bucket_width", 64, "Width of the position buckets.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
    flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
    define_flags()
    app.run(main)

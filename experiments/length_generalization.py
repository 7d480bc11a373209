"""Study: length generalisation on the task suite of Ruoss et al. 2023 (arXiv 2305.16843),
"Randomized positional encodings boost length generalization of transformers".

    python -m experiments.length_generalization --scale=smoke  # about a minute: 1 task, 8 arms
    python -m experiments.length_generalization --scale=cpu    # the page (hours on 2 cores)
    python -m experiments.length_generalization --scale=paper  # their example's sizes
    python -m experiments.length_generalization --scale=cpu --peer  # plus x-transformers
    python -m experiments.length_generalization --scale=cpu --tasks=reverse_string --peer \
        --jobs=2 --peer-threads=1  # one task, two single-threaded runs at a time

Every task of ``configs/length_generalization.py`` with every copejax arm (NoPE, sinusoidal,
RoPE, ALiBi, learned, CoPE, FoX, randomized positions) over seeds: train on input lengths 1
to 40, report the per-output-token accuracy averaged over the test lengths (the ``long``
split, 41 and up) and over the training lengths (``test``), mean ± std over seeds, and each
arm's training step time (median of the logged steps/s after the first window, which holds
the compilation; the median over seeds, with the fastest and slowest seed).

``--peer`` also trains x-transformers (PyTorch; ``experiments/length_generalization_peer.py``,
in a side venv it creates) on the same batches with the same sizes, schedule, steps and seeds
for the arms both have, and puts its accuracy and step time beside copejax's. Without it the
page says that the peer was not run. ``--tasks`` runs a subset of the scale's tasks (the page
then shows only those); ``--jobs`` runs that many copejax runs, and then that many peer runs,
at a time. ``--init-probe`` also trains ``INIT_PROBE_ARMS`` at x-transformers' initial scales
(``INIT_PROBE``) and tables them beside the study's initialisation and the peer's.
``--peer-probe`` also trains the peer's arms in copejax's parametrisation
(``length_generalization_peer``'s ``parametrisation="copejax"``: copejax's embedding scales,
initialisation, bias-free MLP and position-scheme starts in x-transformers' network) and
tables it beside both; ``--peer-probe-arms`` names a subset of them (all by default), for
every task or per task (``reverse_string:nope+rope,odds_first:nope``).
``--records=experiments/records`` keeps the config and metrics of every complete run (and the
peer's results) in the repository and reads them back on the next run
(:mod:`experiments.run_records`), so that the study's ~30 hours on 2 cores can be trained over
several machines; the page's regenerate command then re-reads them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from copejax.config.base import load_config
from copejax.data._length_suite import TASKS, repeat_rule_accuracy
from copejax.data.base import make_task
from experiments import length_generalization_peer as peer_module
from experiments import length_generalization_peer_weights as peer_weights
from experiments import run_records, sweep
from experiments.permutation_test import permutation_p

STUDY = "length_generalization"
CONFIG = "configs/length_generalization.py"
ARMS = ("nope", "sinusoidal", "rope", "alibi", "learned", "cope", "fox", "randomized")
# Arm options beyond ``position=<arm>``: the randomized arm samples at evaluation as well.
ARM_OPTIONS = {"randomized": ",sample_at_eval=True"}
SCALE_TASKS = {"smoke": ("reverse_string",), "cpu": TASKS, "paper": TASKS}
ARGS = {"smoke": "smoke,steps=10", "cpu": "cpu", "paper": "paper"}
SEEDS = {"smoke": 1, "cpu": 5, "paper": 5}  # 5 seeds per arm (issue 19)
REPEAT_RULE = "repeat rule (no model)"  # the row of repeat_rule_accuracy in the accuracy tables
REPEAT_SAMPLES = 64  # sequences per length the repeat rule is scored on (at least)
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
argmax scored per token, as their accuracy is). Their block's MLP is ReLU with biases and
their output layer a separate linear map; copejax's is its `llama` block (RMSNorm, SwiGLU,
no biases) with the output tied to the token embeddings. Their batches share one length
(drawn per batch); here lengths are drawn per example and padded. Their
`experiments/example.py` trains the randomised relative encoding (`NOISY_RELATIVE`,
Transformer-XL's with randomised positions); copejax's `randomized` arm randomises
sinusoidal absolute positions (its default `encoding`) and, as their code does, samples
positions at evaluation too (`sample_at_eval=True`, one fixed key per evaluation). The
initialisation is theirs: every dense kernel starts at haiku's default, a normal truncated at
two std with std 1 / sqrt(fan_in) (`model.dense_init = "fan_in"`), and the token embeddings
at N(0, 0.02²) times sqrt(D).

Teacher forcing hands the decoder each previous output token, which Ruoss et al.'s encoder
never sees. The accuracy tables therefore carry a floor that needs no model, the *repeat
rule*: guess each output token to be the true one before it, and the first to be the most
frequent first output token (`repeat_rule_accuracy` in `copejax/data/_length_suite.py`,
scored on the study's lengths, data seed 0, at least 64 sequences per length). It sits at
chance (about 50 %) on every task but `bucket_sort`: a sorted output changes symbol at most
four times, so repeating is right on all other tokens, about 95 % at 41 to 161 symbols.
There an arm below the rule does worse past the training lengths than copying the previous
token, which a causal decoder can do at any length.

Published numbers: the paper's results table is not retrievable offline (only its abstract
and introduction are), so no published column is shown."""


INIT_PROBE_NOTE = """## Where the peer and copejax differ: an initialisation probe

Where x-transformers and copejax disagree, the first difference between them is where they
start: the study starts every dense kernel as Ruoss et al.'s code does (truncated normal, std
1 / sqrt(fan_in), 0.125 at D = 64) and multiplies the token embeddings by sqrt(D);
x-transformers keeps torch's defaults (Linear: uniform with std 1 / sqrt(3 fan_in), 0.072 at
D = 64; token embeddings Kaiming normal, std 0.18). The probe trains the arms below again with
`dense_init=normal,init_std=0.072,scale_embeddings=False` (every weight N(0, 0.072²)), the
same seeds and batches; everything else unchanged. If the gap closes, the disagreement is the
initialisation, not the position scheme or a bug."""

PEER_NOTE = """x-transformers 2.31.10 (torch 2.13.0, CPU) trained by
`experiments/length_generalization_peer.py` on the batches copejax's trainer feeds, in the
same order, with the same model sizes, AdamW settings, schedule, clipping, steps and seeds;
scored with the task's own metric. Its block: pre-norm RMSNorm, SwiGLU MLP of copejax's width,
tied embeddings, x-transformers' defaults otherwise (its token embeddings start at Kaiming
normal, std sqrt(2 / D) ≈ 0.18 at D = 64, near copejax's 0.02 · sqrt(D) = 0.16);
`sinusoidal` is its scaled sinusoidal embedding (one learned scale, initialised to
D^-1/2); `rope` rotates half of each head's features (its default `rotary_emb_dim =
dim_head // 2`, 8 of 16 at the `cpu` scale, the full frequency spectrum over those 8), where
copejax rotates all of them (`fraction = 1`); `fox` is its data-dependent ALiBi
(forgetting-transformer gate) with the gate's bias started at 5 (f ≈ 0.993, almost no decay
at first), where copejax starts it at 0 (`forget_bias_init`, f ≈ 0.5). These are
x-transformers' choices and are kept; the parametrisation probe below trains the arms again
with copejax's. Accuracies agree
when the means differ by no more than the larger seed std; each such cell also gives p, the
two-sided exact permutation test of the two sets of seeds (every split of the pooled seeds
into two groups, 252 for five a side, so p ≥ 0.008): a small p says that the two seed sets
differ by more than reshuffling them does, a large one that five seeds cannot tell the two
apart, whatever the std rule says. Step times are medians after five steps, on a shared
machine, and each cell the median over seeds (fastest-slowest seed); torch ran with
{threads}, and as many peer runs at a time as copejax runs (the header says how those were
trained)."""


# The initialisation probe (``--init-probe``): copejax arms started at x-transformers' scales
# instead of the study's: torch's default Linear init (uniform, std 1 / sqrt(3 fan_in) = 0.072
# at fan_in = D = 64) for every weight, and no sqrt(D) on the token embeddings.
INIT_PROBE = ",dense_init=normal,init_std=0.072,scale_embeddings=False"
INIT_PROBE_ARMS = ("nope", "alibi", "fox")
INITS = ("study init", "torch-scale init")
PEER_PROBE_ARMS = peer_module.ARMS  # --peer-probe-arms: a subset
PEER_PROBE = "copejax"  # the peer's parametrisation in the probe

PEER_PROBE_NOTE = """## Where the peer and copejax differ: a parametrisation probe

x-transformers and copejax's study config build the same function at initialisation (a pre-norm
RMSNorm block with SwiGLU and tied embeddings) but parametrise and start it differently:
x-transformers keeps its token table at Kaiming scale (std 0.18) and multiplies the tied logits
by D^-1/2, where copejax keeps the table at 0.02 and multiplies the embeddings by sqrt(D), so
that Adam's steps, of one size whatever the scale, move copejax's embeddings about 8 times
faster; its linear kernels start at torch's uniform (std 1 / sqrt(3 fan_in)), copejax's at a
truncated normal (std 1 / sqrt(fan_in)); its SwiGLU has biases. The position schemes' own
weights start differently too: x-transformers' sinusoidal table has a learned scale started at
D^-1/2 (copejax adds it at scale 1); its learned table is N(0, 1) read times D^-1/2 (copejax's
N(0, 0.02²) at scale 1); its RoPE rotates half of each head (copejax all of it); its FoX gate
starts with a bias of 5 and torch's uniform kernel (copejax's at 0 and N(0, 0.02²)). ALiBi has
no weights and both CoPE tables start at zero. The probe trains x-transformers again, the same
seeds and batches, with all of copejax's choices (`length_generalization_peer.py
--parametrisation=copejax`). Where it lands on copejax's numbers, the gap between copejax and
x-transformers' defaults is the parametrisation. The check below shows that this network is
copejax's function and trains as copejax's does; where the probe still misses copejax's
spread, only the random draw of the initial weights differs (torch's generator against
JAX's), and the distance shows how far five-seed means move by that draw alone."""


SAME_FUNCTION_NOTE = """### The same function: copejax's weights in the peer

`experiments/length_generalization_peer_weights.py` copies copejax's initial weights (plus
N(0, {noise}²) on every weight, so that the ones that start at zero take part) into
x-transformers in copejax's parametrisation, compares the logits on a batch of random tokens,
and trains both from those weights for {steps} steps on the study's first `{task}` batches
(copejax with optax's AdamW, the peer with torch's). Where logits and losses agree, the two
implementations build and train the same function: a gap between the probe's accuracies and
copejax's is then the random initialisation (torch's generator against JAX's) and the seeds,
not the code."""


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


def label(task: str, arm: str) -> str:
    return f"{task}, {arm}"


def probe_label(task: str, arm: str) -> str:
    return f"{task}, {arm}, torch-scale init"


def step_ms(records: Sequence[Mapping[str, float]]) -> float:
    """Milliseconds per training step: 1000 / the median logged steps/s, the first logged
    window (compilation) left out when there are others."""
    speeds = [r["train/steps_per_sec"] for r in records if "train/steps_per_sec" in r]
    speeds = speeds[1:] if len(speeds) > 1 else speeds
    return 1000.0 / statistics.median(speeds) if speeds else float("nan")


def summarize(
    result: sweep.Sweep,
    tasks: Sequence[str],
    arms: Sequence[str] = ARMS,
    label_of: Callable[[str, str], str] = label,
) -> dict[str, dict[str, Any]]:
    """arm -> task -> {split: spread of accuracy, "step_ms": spread} of the runs labelled
    ``label_of(task, arm)`` (the study's arms, or the init probe's with ``probe_label``)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        for task in tasks:
            key = label_of(task, arm)
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


def length_curves(result: sweep.Sweep, task: str) -> dict[str, list[list[tuple[float, float]]]]:
    """arm -> per seed, (input length, accuracy) over the training and test lengths of the
    last evaluation (``test/accuracy/<n>`` and ``long/accuracy/<n>``)."""
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for arm in ARMS:
        for records in result.records.get(label(task, arm), []):
            final = sweep.last_eval(records)
            points = {
                int(key.rsplit("/", 1)[1]): float(value)
                for key, value in final.items()
                if key.startswith(("test/accuracy/", "long/accuracy/"))
            }
            curves.setdefault(arm, []).append(sorted(points.items()))
    return curves


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


def repeat_rule(tasks: Sequence[str], scale: str) -> dict[str, dict[str, dict[str, float]]]:
    """task -> split -> :func:`repeat_rule_accuracy` (``accuracy`` and ``accuracy/<n>``) on
    the study's evaluation splits at ``scale``, data seed 0, at least ``REPEAT_SAMPLES``
    sequences per length."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task in tasks:
        options = load_config(CONFIG, f"{task},{ARGS[scale]}").task.options.to_dict()
        per_length = max(options.get("samples_per_length", 0), REPEAT_SAMPLES)
        made = make_task(task, {**options, "samples_per_length": per_length})
        out[task] = {split: repeat_rule_accuracy(made, split, seed=0) for split in SPLITS}
    return out


def repeat_curve(by_split: Mapping[str, Mapping[str, float]]) -> list[tuple[int, float]]:
    """(input length, accuracy) of the repeat rule over the training and test lengths of one
    task, from its :func:`repeat_rule` entry."""
    points = {
        int(key.rsplit("/", 1)[1]): float(value)
        for summary in by_split.values()
        for key, value in summary.items()
        if key.startswith("accuracy/")
    }
    return sorted(points.items())


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


def _threads(threads: int) -> str:
    return "its default threads" if threads == 0 else f"{threads} thread(s)"


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


def run_peer(
    tasks: Sequence[str],
    scale: str,
    seeds: Sequence[int],
    workroot: str,
    threads: int,
    *,
    jobs: int = 1,
    parametrisation: str = peer_module.PARAMETRISATIONS[0],
    arms: Sequence[str] = peer_module.ARMS,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """x-transformers results: arm -> task -> one result dict per seed (cached as JSON under
    ``<workroot>/length_generalization/<scale>/peer``, so a re-run only reads them). Runs not
    cached yet train ``jobs`` at a time, each in its own side-venv process, for ``arms``.
    Runs with ``parametrisation="copejax"`` (the probe) are cached apart."""
    cache = Path(workroot) / STUDY / scale / run_records.PEER
    cache.mkdir(parents=True, exist_ok=True)
    default = parametrisation == peer_module.PARAMETRISATIONS[0]
    runs = [(task, arm, seed) for task in tasks for arm in arms for seed in seeds]
    suffix = "" if default else f"_{parametrisation}"

    def path_of(task: str, arm: str, seed: int) -> Path:
        return cache / f"{task}_{arm}_seed{seed}{suffix}.json"

    def train(run: tuple[str, str, int]) -> None:
        task, arm, seed = run
        print(f"== peer x-transformers ({parametrisation}) {task}, {arm} seed {seed}", flush=True)
        config_arg = f"{task},{ARGS[scale]},seed={seed}"
        result = peer_module.run(config_arg, arm, threads, parametrisation)
        path_of(*run).write_text(json.dumps(result))

    todo = [run for run in runs if not path_of(*run).exists()]
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(train, todo))  # re-raises a failed run's error
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for task, arm, seed in runs:
        result = json.loads(path_of(task, arm, seed).read_text())
        out.setdefault(arm, {}).setdefault(task, []).append(result)
    return out


def select_subset(flag: str, names: str, allowed: Sequence[str], owner: str) -> tuple[str, ...]:
    """``allowed``, or the comma-separated subset ``names`` of it (in ``allowed``'s order); an
    unknown or empty choice is an error naming ``flag`` and listing what ``owner`` has."""
    if not names:
        return tuple(allowed)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in allowed]
    if unknown or not chosen:
        raise SystemExit(
            f"{flag}={names!r}: unknown {unknown or 'empty'}; {owner} has {', '.join(allowed)}"
        )
    return tuple(a for a in allowed if a in chosen)


def select_tasks(scale: str, names: str) -> tuple[str, ...]:
    """The scale's tasks, or the comma-separated subset ``names`` of them."""
    return select_subset("--tasks", names, SCALE_TASKS[scale], f"the {scale} scale")


def select_probe_arms(names: str) -> tuple[str, ...]:
    """``PEER_PROBE_ARMS``, or the comma-separated subset ``names`` of them."""
    return select_subset("--peer-probe-arms", names, PEER_PROBE_ARMS, "the peer")


def select_probe_plan(spec: str, tasks: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """task -> the peer arms the parametrisation probe trains on it, from
    ``--peer-probe-arms``: empty (every peer arm on every task), a comma-separated subset of
    the arms for every task, or ``TASK:ARM+ARM`` entries, comma-separated, one per probed task
    (a task not named is not probed). A task outside ``tasks``, a task named twice or a mix
    of the two forms is an error."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    per_task = [e for e in entries if ":" in e]
    if not per_task:
        return dict.fromkeys(tasks, select_probe_arms(spec))
    if len(per_task) != len(entries):
        raise SystemExit(
            f"--peer-probe-arms={spec!r}: give either arms for every task (nope,rope) or "
            "TASK:ARM+ARM entries for each probed task, not both"
        )
    plan: dict[str, tuple[str, ...]] = {}
    for entry in per_task:
        task, arms = (part.strip() for part in entry.split(":", 1))
        if task not in tasks or task in plan:
            why = "named twice" if task in plan else "not among the page's tasks"
            raise SystemExit(
                f"--peer-probe-arms={spec!r}: task {task!r} {why}; the page has {', '.join(tasks)}"
            )
        if not arms:
            raise SystemExit(f"--peer-probe-arms={spec!r}: task {task!r} names no arm")
        plan[task] = select_probe_arms(arms.replace("+", ","))
    return {task: plan[task] for task in tasks if task in plan}


def probe_plan_flag(plan: Mapping[str, Sequence[str]], tasks: Sequence[str]) -> str:
    """The ``--peer-probe-arms`` value that ``select_probe_plan`` reads back as ``plan``:
    empty when every task has every peer arm, the arms alone when every task has the same."""
    probed = [tuple(plan.get(task, ())) for task in tasks]
    if len(set(probed)) == 1 and probed[0]:
        return "" if probed[0] == PEER_PROBE_ARMS else ",".join(probed[0])
    return ",".join(f"{task}:{'+'.join(arms)}" for task, arms in plan.items() if arms)


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


def page_options(own: argparse.Namespace, tasks: Sequence[str], scale: str) -> list[str]:
    """The flags beyond ``--scale`` that this page was made with, so that its regenerate
    command makes the same page (the same tasks, peer and probe sections)."""
    options = [] if tuple(tasks) == SCALE_TASKS[scale] else [f"--tasks={','.join(tasks)}"]
    if own.peer:
        options.append("--peer")
        if own.peer_threads:
            options.append(f"--peer-threads={own.peer_threads}")
    if own.init_probe:
        options.append("--init-probe")
    if own.peer_probe:
        options.append("--peer-probe")
        flag = probe_plan_flag(select_probe_plan(own.peer_probe_arms, tasks), tasks)
        if flag:
            options.append(f"--peer-probe-arms={flag}")
    if own.records:
        options.append(f"--records={own.records}")
    return options


def main(argv: Sequence[str] | None = None) -> Path:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--peer", action="store_true", help="also run x-transformers")
    extra.add_argument("--peer-threads", type=int, default=0, help="torch threads (0: default)")
    extra.add_argument("--tasks", default="", help="comma-separated subset of the scale's tasks")
    extra.add_argument(
        "--init-probe", action="store_true", help="also train INIT_PROBE_ARMS at torch's scales"
    )
    extra.add_argument(
        "--peer-probe",
        action="store_true",
        help="also train the peer's arms in copejax's parametrisation",
    )
    extra.add_argument(
        "--peer-probe-arms",
        default="",
        help="comma-separated subset of the probe's arms, or TASK:ARM+ARM per probed task",
    )
    extra.add_argument("--records", default="", help="keep and reuse complete runs here")
    own, rest = extra.parse_known_args(argv)
    args = sweep.parse_args(rest, STUDY)
    tasks = select_tasks(args.scale, own.tasks)
    probe_plan = select_probe_plan(own.peer_probe_arms, tasks)

    def arm_arg(task: str, arm: str) -> str:
        return f"{task},{ARGS[args.scale]},position={arm}{ARM_OPTIONS.get(arm, '')}"

    arms = [sweep.Arm(label(t, a), CONFIG, arm_arg(t, a)) for t in tasks for a in ARMS]
    if own.init_probe:
        arms += [
            sweep.Arm(probe_label(t, a), CONFIG, arm_arg(t, a) + INIT_PROBE)
            for t in tasks
            for a in INIT_PROBE_ARMS
        ]
    result = sweep.run_sweep(
        STUDY,
        args.scale,
        arms,
        sweep.seeds_for(args, SEEDS[args.scale]),
        args.workroot,
        jobs=args.jobs,
        records_dir=own.records,
    )
    summary = summarize(result, tasks)
    repeat = repeat_rule(tasks, args.scale)

    def peer_runs(
        parametrisation: str, arms: Sequence[str], tasks: Sequence[str] = tasks
    ) -> dict[str, dict[str, list[dict[str, Any]]]]:
        seeds = sweep.seeds_for(args, SEEDS[args.scale])
        found = run_peer(
            tasks,
            args.scale,
            seeds,
            args.workroot,
            own.peer_threads,
            jobs=args.jobs,
            parametrisation=parametrisation,
            arms=arms,
        )
        if own.records:
            run_records.save(args.workroot, own.records, STUDY, args.scale)
        return found

    peer = peer_runs(peer_module.PARAMETRISATIONS[0], peer_module.ARMS) if own.peer else {}
    probe: dict[str, dict[str, list[dict[str, Any]]]] = {}
    if own.peer_probe:
        for task, arms_of_task in probe_plan.items():
            for arm, by_task in peer_runs(PEER_PROBE, arms_of_task, [task]).items():
                probe.setdefault(arm, {}).update(by_task)
    probed = [arm for arm in PEER_PROBE_ARMS if any(arm in a for a in probe_plan.values())]
    same_task = f"{tasks[0]},{ARGS[args.scale]}"
    same = {arm: peer_weights.compare(same_task, arm) for arm in probed} if own.peer_probe else {}
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
    curve_images = []
    for task in tasks:
        path = sweep.plot_path(args.out, STUDY, args.scale, task)
        sweep.curve_plot(
            {**length_curves(result, task), REPEAT_RULE: [repeat_curve(repeat[task])]},
            path,
            xlabel="input length n",
            ylabel="per-token accuracy",
            title=f"{task}: accuracy by input length",
        )
        curve_images.append(f"![{task}]({path.name})")
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
            table(summary, tasks, "long", repeat),
            "",
            f"![accuracy]({plot.name})",
            "",
            reading(summary, tasks, repeat),
            "",
            f"Every seed's accuracy (seeds {', '.join(map(str, result.seeds))}, in that order):",
            "",
            sweep.per_seed_table(result, {f"{s}/accuracy": f"{SPLITS[s]} %" for s in SPLITS}),
            "",
            "Accuracy by input length (mean over seeds, band: one std), last evaluation, with "
            f"the {REPEAT_RULE}:",
            "",
            *curve_images,
            "",
            "## Accuracy on the training lengths",
            "",
            table(summary, tasks, "test", repeat),
            "",
            "## Step time",
            "",
            "Milliseconds per training step (1000 / the median logged steps/s after the "
            "first window), the median over seeds and, in brackets, the fastest and the "
            "slowest seed. Runs train as many at a time as the header says; a run that "
            "trains partly alone (the last of a sweep) reads faster, which the range shows "
            f"and the median leaves out (`{ARMS[-1]}` trains last).",
            "",
            time_table(summary, tasks),
            "",
            "## Peer implementation: x-transformers",
            "",
            PEER_NOTE.format(threads=_threads(own.peer_threads))
            if peer
            else "Not run yet: the x-transformers (PyTorch) arms on the same "
            "generated data, sizes, steps and seeds (`--peer`).",
            "",
            peer_section(summary, peer, tasks) if peer else "",
            "",
            "Every x-transformers seed's accuracy (the same seeds, in the same order):\n\n"
            + peer_per_seed(peer, tasks)
            if peer
            else "",
            "",
            INIT_PROBE_NOTE + "\n\n" + init_probe_section(result, peer, tasks)
            if own.init_probe
            else "",
            "",
            PEER_PROBE_NOTE + "\n\n" + peer_probe_section(summary, peer, probe, tasks)
            if probe
            else "",
            "",
            SAME_FUNCTION_NOTE.format(
                noise=peer_weights.NOISE, steps=peer_weights.STEPS, task=tasks[0]
            )
            + "\n\n"
            + same_function_section(same)
            if same
            else "",
            "",
            sweep.commands_block(STUDY, args, result, page_options(own, tasks, args.scale)),
        ]
    )
    return sweep.write_outputs(
        args.out,
        STUDY,
        args.scale,
        page,
        result,
        results=summary,
        repeat_rule=repeat,
        peer=peer_json(peer),
        init_probe=summarize(result, tasks, INIT_PROBE_ARMS, probe_label) if own.init_probe else {},
        peer_probe=peer_json(probe),
        same_function=same,
    )


def peer_json(
    peer: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
) -> dict[str, dict[str, Any]]:
    """arm -> task -> {split: spread of accuracy, "step_ms": spread} of the peer's runs, in
    the shape of copejax's ``results``."""
    out: dict[str, dict[str, Any]] = {}
    for arm, by_task in peer.items():
        for task, runs in by_task.items():
            cell = {}
            for key in [f"{s}/accuracy" for s in SPLITS] + ["step_ms"]:
                values = [r[key] for r in runs]
                cell[key.split("/")[0]] = sweep.spread(*sweep.mean_std(values), values)
            out.setdefault(arm, {})[task] = cell
    return out


if __name__ == "__main__":
    main()

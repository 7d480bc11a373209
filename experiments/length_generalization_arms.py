"""The length-generalisation study's definition (``experiments.length_generalization``):
its tasks per scale, copejax arms and seeds, the probes' arms and options, the run labels, and
the choice of a subset of tasks or probe arms from the command line."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from copejax.data._length_suite import TASKS
from experiments import length_generalization_peer as peer_module

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


# The initialisation probe (``--init-probe``): copejax arms started at x-transformers' scales
# instead of the study's: torch's default Linear init (uniform, std 1 / sqrt(3 fan_in) = 0.072
# at fan_in = D = 64) for every weight, and no sqrt(D) on the token embeddings.
INIT_PROBE = ",dense_init=normal,init_std=0.072,scale_embeddings=False"


INIT_PROBE_ARMS = ("nope", "alibi", "fox")


INITS = ("study init", "torch-scale init")


PEER_PROBE_ARMS = peer_module.ARMS  # --peer-probe-arms: a subset


PEER_PROBE = "copejax"  # the peer's parametrisation in the probe


def label(task: str, arm: str) -> str:
    return f"{task}, {arm}"


def probe_label(task: str, arm: str) -> str:
    return f"{task}, {arm}, torch-scale init"


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

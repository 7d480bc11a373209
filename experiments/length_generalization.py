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

This module is the command line; the study's parts are apart: its definition
(``length_generalization_arms``), its numbers from the runs (``length_generalization_results``),
its tables (``length_generalization_tables``) and its page (``length_generalization_page``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments import length_generalization_peer as peer_module
from experiments import length_generalization_peer_weights as peer_weights
from experiments import run_records, sweep, sweep_page, sweep_plots
from experiments.length_generalization_arms import (
    ARGS,
    ARM_OPTIONS,
    ARMS,
    CONFIG,
    INIT_PROBE,
    INIT_PROBE_ARMS,
    PEER_PROBE,
    PEER_PROBE_ARMS,
    REPEAT_RULE,
    SCALE_TASKS,
    SEEDS,
    STUDY,
    label,
    probe_label,
    probe_plan_flag,
    select_probe_plan,
    select_tasks,
)
from experiments.length_generalization_page import render
from experiments.length_generalization_results import (
    length_curves,
    peer_json,
    repeat_curve,
    repeat_rule,
    run_peer,
    summarize,
)


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
    plot = sweep_plots.plot_path(args.out, STUDY, args.scale, "accuracy")
    sweep_plots.bar_plot(
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
        path = sweep_plots.plot_path(args.out, STUDY, args.scale, task)
        sweep_plots.curve_plot(
            {**length_curves(result, task), REPEAT_RULE: [repeat_curve(repeat[task])]},
            path,
            xlabel="input length n",
            ylabel="per-token accuracy",
            title=f"{task}: accuracy by input length",
        )
        curve_images.append(f"![{task}]({path.name})")
    page = render(
        scale=args.scale,
        tasks=tasks,
        result=result,
        summary=summary,
        repeat=repeat,
        peer=peer,
        probe=probe,
        same=same,
        init_probe=own.init_probe,
        peer_threads=own.peer_threads,
        plot_name=plot.name,
        curve_images=curve_images,
        commands=sweep_page.commands_block(
            STUDY, args, result, page_options(own, tasks, args.scale)
        ),
    )
    return sweep_page.write_outputs(
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


if __name__ == "__main__":
    main()

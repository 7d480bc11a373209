"""Training: validate the config, build the mesh and sharded state, then train, evaluate, save.

The loop of nanodo and flax's lm1b example (decoder-only LM training, Vaswani et al. 2017,
arXiv 1706.03762) with the checks a long research run needs: every config problem is a
ValueError before any compute, the workdir belongs to one config, a re-run resumes from the
latest readable checkpoint (an unreadable one is reported and set aside) with metrics identical
to an uninterrupted run, a non-finite loss stops (or skips) and non-finite state is never saved.
One run at a time holds a workdir (copejax.runtime.workdir_lock); SIGTERM or Ctrl-C saves the
current
step and stops (copejax.runtime.preemption).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from copejax.model import param_paths
from copejax.model.transformer import Transformer
from copejax.runtime import workdir
from copejax.runtime.checkpoint import Checkpointer
from copejax.runtime.metrics import MetricsWriter, truncate_after
from copejax.runtime.preemption import Preempted, StopSignal
from copejax.runtime.progress import Progress
from copejax.runtime.workdir_lock import WorkdirLock, WorkdirUnusableError, prepare
from copejax.training import finetune, input_pipeline, resume
from copejax.training.plan import Plan, validate
from copejax.training.train_step import Steps, make_steps


class NonFiniteLossError(RuntimeError):
    """Training stopped at a step whose loss or gradient norm was not finite."""


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    """True when every floating-point value of ``tree`` is finite (checked before a save)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.isdtype(x.dtype, "real floating")
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def evaluate(
    steps: Steps,
    params: Any,
    plan: Plan,
    config: ml_collections.ConfigDict,
    mesh: jax.sharding.Mesh,
) -> dict[str, float]:
    """Loss and task metrics of every eval split (``eval/<split>/<name>``)."""
    results: dict[str, float] = {}
    index, count = jax.process_index(), jax.process_count()
    for split in plan.eval_splits:
        loss_sum = scored = 0.0
        totals: dict[str, float] = {}
        batches = input_pipeline.eval_batches(
            plan.task,
            split,
            config.seed,
            config.eval.batch_size,
            max_examples=config.eval.max_examples,
            process_index=index,
            process_count=count,
        )
        for local, real in batches:
            out = steps.evaluate(params, _global_batch(local, steps.batch_sharding))
            loss_sum += float(out["loss_sum"])
            scored += float(out["scored"])
            local_predictions = multihost_utils.global_array_to_host_local_array(
                out["predictions"], mesh, steps.batch_sharding.spec
            )
            predictions = np.asarray(local_predictions)[:real]
            rows = {key: value[:real] for key, value in local.items()}
            for key, value in plan.task.metrics(rows, predictions).items():
                totals[key] = totals.get(key, 0.0) + float(value)
        if count > 1:
            keys = sorted(totals)
            summed = multihost_utils.process_allgather(np.array([totals[k] for k in keys]))
            totals = dict(zip(keys, np.asarray(summed).sum(axis=0).tolist(), strict=True))
        results[f"eval/{split}/loss"] = loss_sum / max(scored, 1.0)
        for key, value in plan.task.summarize(totals).items():
            results[f"eval/{split}/{key}"] = float(value)
    return results


def _global_batch(local: dict[str, np.ndarray], batch_sharding: Any) -> dict[str, jax.Array]:
    return {
        key: jax.make_array_from_process_local_data(batch_sharding, value)
        for key, value in local.items()
    }


def run(
    config: ml_collections.ConfigDict,
    workdir_path: str | os.PathLike,
    restart: bool = False,
    stop_after: int | None = None,
) -> dict[str, float]:
    """Trains ``config`` in ``workdir_path`` (resuming when it holds this config's checkpoints).

    ``stop_after`` ends this invocation after that step (as a preemption would; what was saved
    stays), without changing the run's config: re-running resumes.

    Returns the last logged metrics (train and eval). Raises ValueError for a bad config or a
    workdir holding a different run, NonFiniteLossError when ``train.nonfinite`` is "stop" and
    a step's loss or gradient is not finite.
    """
    plan = validate(config, process_count=jax.process_count())
    resolved = workdir.config_to_dict(config)
    root = Path(workdir_path)
    main_process = jax.process_index() == 0
    with contextlib.ExitStack() as locked:
        _lock_workdir(root, main_process, locked)
        wipe = workdir.check(root, resolved, restart)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("copejax: workdir checked")
        if main_process:
            if wipe:
                deleted = workdir.wipe(root)
                print(f"--restart: deleted {', '.join(deleted)} in {root}", flush=True)
            try:
                workdir.write_json_atomic(root / workdir.CONFIG_FILE, resolved)
            except OSError as error:
                raise WorkdirUnusableError(
                    f"--workdir {root} is not writable ({error.strerror})"
                ) from None
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("copejax: workdir ready")
        return _run_locked(
            config, plan, root, resolved, main_process=main_process, stop_after=stop_after
        )


def _lock_workdir(root: Path, main_process: bool, stack: contextlib.ExitStack) -> None:
    """Process 0 creates and locks the workdir; every process learns whether that worked."""
    error: ValueError | None = None
    if main_process:
        try:
            prepare(root)
            lock = WorkdirLock(root)
            lock.acquire()
            stack.callback(lock.release)
        except ValueError as failed:
            error = failed
    if jax.process_count() > 1:
        ok = multihost_utils.broadcast_one_to_all(np.int32(error is None))
        if not main_process and not int(ok):
            raise WorkdirUnusableError(f"process 0 could not take --workdir {root}; see its error")
    if error is not None:
        raise error


def _run_locked(
    config: ml_collections.ConfigDict,
    plan: Plan,
    root: Path,
    resolved: dict[str, Any],
    *,
    main_process: bool,
    stop_after: int | None,
) -> dict[str, float]:
    """``run`` once the workdir is locked and holds this run's config."""
    mesh, rules = plan.mesh, plan.rules
    # Inside the mesh context the model's activation sharding constraints (logical names
    # through the rules) take effect; jax.jit also gets explicit in/out shardings.
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules), contextlib.ExitStack() as stack:
        return _train(
            config,
            plan,
            root,
            mesh=mesh,
            rules=rules,
            resolved=resolved,
            stack=stack,
            main_process=main_process,
            stop_after=stop_after,
        )


def _train(
    config: ml_collections.ConfigDict,
    plan: Plan,
    root: Path,
    *,
    mesh: jax.sharding.Mesh,
    rules: Any,
    resolved: dict[str, Any],
    stack: contextlib.ExitStack,
    main_process: bool,
    stop_after: int | None,
) -> dict[str, float]:
    train = config.train
    model = Transformer(plan.model_config)
    init_shape = (plan.batch_ways, plan.task.seq_len)
    steps = make_steps(
        model, train, config.seed, init_shape, mesh=mesh, rules=rules, optimizer=plan.optimizer
    )
    data = input_pipeline.train_iterator(
        plan.task,
        config.seed,
        train.batch_size,
        shuffle=config.data.shuffle,
        worker_count=config.data.worker_count,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    ckpt = Checkpointer(root / "checkpoints", train.keep_checkpoints)
    stack.callback(ckpt.close)

    saved_configs: dict[int, dict[str, Any]] = {}

    def check_config(step: int, saved: dict[str, Any]) -> bool:
        """Refuses another run's checkpoint; True when its data-iterator state fits."""
        if not workdir.same_run(saved, resolved):
            raise workdir.WorkdirConflictError(
                workdir.refusal(f"checkpoint {step} in {root}", saved, resolved)
            )
        saved_configs[step] = saved
        return saved.get("data", {}).get("worker_count") == config.data.worker_count

    host = _empty_window()
    upgrade = param_paths.checkpoint_upgrade(plan.model_config)  # runs saved before 0.2.0
    restored = ckpt.restore_latest(steps.abstract_state, data, check_config, upgrade)
    if restored is None:
        state, start = steps.init(), 0
        if plan.init_source is not None:
            state = _start_from(state, steps, plan, main_process)
    else:
        start, state, host = restored.step, restored.state, restored.host or host
        _check_steps(start, train.steps, root)
        lines = resume.changes(saved_configs[start], resolved, train, restored, mesh)
        lines.append(resume.position_data(data, restored, config.data.worker_count) or "")
        said = "".join(f"\n{line}" for line in lines if line)
        changed = f" with changes:{said}" if said else ""
        print(f"resumed from checkpoint {start} in {root / 'checkpoints'}{changed}", flush=True)
    if main_process:  # a resumed run re-does the steps after its checkpoint
        truncate_after(root / "metrics.jsonl", start)

    # After truncate_after (it appends); TensorBoard hides older events after ``start``.
    writer = MetricsWriter(root, enabled=main_process, resumed_from=start)
    stack.callback(writer.close)
    tokens_per_step = train.batch_size * plan.task.seq_len
    progress = Progress(train.steps, start, tokens_per_step)
    last: dict[str, float] = {}
    last_saved = start if start > 0 else None
    stop = stack.enter_context(StopSignal(ckpt.manager))
    window_skipped = 0

    def save(step: int) -> None:
        if not bool(_all_finite((state.params, state.opt_state))):
            ckpt.wait()
            raise NonFiniteLossError(
                f"the train state at step {step} holds non-finite values, so it was not "
                f"saved; last good checkpoint: {_last_good(last_saved, root)}"
            )
        ckpt.save(step, state, data, resolved, host)

    for step in range(start + 1, train.steps + 1):
        state, out = steps.train(state, _global_batch(next(data), steps.batch_sharding))
        out = jax.device_get(out)
        if not out["finite"]:
            if train.nonfinite == "stop":
                ckpt.wait()
                raise NonFiniteLossError(
                    f"non-finite loss ({float(out['loss'])}) or gradient norm "
                    f"({float(out['grad_norm'])}) at step {step}; the state was not updated "
                    f"and nothing was saved; last good checkpoint: {_last_good(last_saved, root)}"
                    " (re-run with --config.train.nonfinite=skip to resume from it skipping "
                    "such batches)"
                )
            window_skipped += 1
        else:
            host = _add_to_window(host, out)
        record: dict[str, float] = {}
        if train.log_every and (step % train.log_every == 0 or step == train.steps):
            record.update(_window_record(host, out, state, progress.update(step)))
            progress.print(step, record, skipped=window_skipped)
            host, window_skipped = _empty_window(), 0
        if (train.eval_every and step % train.eval_every == 0) or step == train.steps:
            with progress.paused():
                record.update(evaluate(steps, state.params, plan, config, mesh))
            progress.print_eval(step, record)
        if record:
            writer.write(step, record)
            last.update(record)
        if (train.checkpoint_every and step % train.checkpoint_every == 0) or step == train.steps:
            with progress.paused():
                save(step)
            last_saved = step
        if stop.reached(step):
            if last_saved != step:
                save(step)
                last_saved = step
            ckpt.wait()
            raise Preempted(
                f"stopped by {stop.name()} at step {step}: saved checkpoint {step} in "
                f"{root / 'checkpoints'}; run the same command to resume",
                stop.exit_code(),
            )
        if stop_after is not None and step >= stop_after:
            break
    if start == train.steps:
        print(f"run already complete at step {start}; nothing to do", flush=True)
        step = start
    _report_skipped(int(state.nonfinite_count), step, root)
    return last


def _check_steps(start: int, steps: int, root: Path) -> None:
    """A resumed run may extend ``train.steps``, not end before a step it has saved."""
    if start > steps:
        raise ValueError(
            f"train.steps={steps} is below checkpoint {start} in {root / 'checkpoints'}: the "
            f"run has trained further; set train.steps >= {start} to resume or extend it (or "
            "train a new --workdir with --config.train.init_from=<this workdir>)"
        )


def _start_from(state: Any, steps: Steps, plan: Plan, main_process: bool) -> Any:
    """The initial state with the plan's ``train.init_from`` weights
    (``copejax.training.finetune``); logs what was copied and which of the new scheme's
    parameters were added."""
    params, log = finetune.initial_params(
        jax.device_get(state.params), plan.model_config, plan.init_source
    )
    if main_process:
        print(log, flush=True)
    place = lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda i: np.asarray(x)[i])
    return state.replace(params=jax.tree.map(place, params, steps.state_shardings.params))


def _empty_window() -> dict[str, float]:
    """The host-side sums of one logging window (saved with each checkpoint)."""
    return {"loss_sum": 0.0, "grad_norm_sum": 0.0, "count": 0.0}


def _add_to_window(host: dict[str, float], out: dict[str, Any]) -> dict[str, float]:
    return {
        "loss_sum": host["loss_sum"] + float(out["loss"]),
        "grad_norm_sum": host["grad_norm_sum"] + float(out["grad_norm"]),
        "count": host["count"] + 1,
    }


def _window_record(
    host: dict[str, float], out: dict[str, Any], state: Any, speed: dict[str, float]
) -> dict[str, float]:
    """The train/* scalars of a logging window. A window whose steps were all skipped has no
    loss: NaN, written as JSON null and left out of TensorBoard (never 0, which would look
    like a perfect fit)."""
    count = host["count"] or float("nan")
    return {
        "train/loss": host["loss_sum"] / count,
        "train/grad_norm": host["grad_norm_sum"] / count,
        "train/learning_rate": float(out["learning_rate"]),
        "train/nonfinite_steps": float(state.nonfinite_count),
        **speed,
    }


def _last_good(last_saved: int | None, root: Path) -> str:
    where = f"checkpoint {last_saved}" if last_saved else "none saved yet"
    return f"{where} in {root / 'checkpoints'}"


def _report_skipped(skipped: int, steps_done: int, root: Path) -> None:
    """Says how many steps ``train.nonfinite=skip`` skipped; a run that skipped all failed."""
    if not skipped:
        return
    if skipped >= steps_done:
        raise NonFiniteLossError(
            f"all {steps_done} steps had a non-finite loss or gradient and were skipped "
            f"(train.nonfinite=skip): the model did not train. See {root / 'metrics.jsonl'}"
        )
    print(
        f"warning: {skipped} of {steps_done} steps were skipped (non-finite loss or gradient, "
        f"train.nonfinite=skip); their batches did not train the model",
        file=sys.stderr,
        flush=True,
    )

"""Training: validate the config, build the mesh and sharded state, then train, evaluate, save.

The loop of nanodo and flax's lm1b example (decoder-only LM training, Vaswani et al. 2017,
arXiv 1706.03762) with the checks a long research run needs: every config problem is a
ValueError before any compute, the workdir belongs to one config, a re-run resumes from the
latest readable checkpoint (an unreadable one is reported and set aside) with metrics identical
to an uninterrupted run, a non-finite loss stops (or skips) and non-finite state is never saved.
One run at a time holds a workdir (copejax.workdir_lock); SIGTERM or Ctrl-C saves the current
step and stops (copejax.preemption).
"""

from __future__ import annotations

import contextlib
import dataclasses
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

from copejax import input_pipeline, optim, shape_checks, sharding, workdir
from copejax.checkpoint import Checkpointer
from copejax.config_base import NONFINITE
from copejax.data.base import Task, make_task
from copejax.metrics import MetricsWriter, truncate_after, truncate_events_after
from copejax.model import Transformer
from copejax.model_config import ModelConfig, upgrade_attention_options
from copejax.preemption import Preempted, StopSignal
from copejax.progress import Progress
from copejax.train_step import Steps, make_steps
from copejax.workdir_lock import WorkdirLock, WorkdirUnusableError, prepare


class NonFiniteLossError(RuntimeError):
    """Training stopped at a step whose loss or gradient norm was not finite."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a validated config resolves to."""

    task: Task
    model_config: ModelConfig
    mesh_shape: tuple[int, int, int]
    eval_splits: tuple[str, ...]


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    """True when every floating-point value of ``tree`` is finite (checked before a save)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.isdtype(x.dtype, "real floating")
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def model_config(config: ml_collections.ConfigDict, task: Task) -> ModelConfig:
    """The ModelConfig of ``config.model``: vocab from the task, 0 sizes resolved."""
    m = config.model
    attention, position_options = upgrade_attention_options(m.to_dict())
    return ModelConfig(
        vocab_size=len(task.vocab),
        d_model=m.d_model,
        num_heads=m.num_heads,
        num_layers=m.num_layers,
        head_dim=m.head_dim or None,
        mlp_dim=m.mlp_dim or None,
        block=m.block,
        tie_embeddings=m.tie_embeddings,
        dropout=m.dropout,
        dtype=m.dtype,
        position=m.position,
        position_options=position_options,
        max_len=m.max_len or task.seq_len,
        init_std=m.init_std,
        **attention,
        **layout_options(m),
    )


def layout_options(m: ml_collections.ConfigDict) -> dict[str, Any]:
    """The attention-layout fields of ``config.model`` (defaults for configs saved before them)."""
    defaults = ModelConfig(vocab_size=1)
    keys = (
        "attention_sink",
        "logit_scaling",
        "ssmax_scale",
        "ssmax_learned",
        "llama4_floor_scale",
        "llama4_attn_scale",
    )
    options = {key: m.get(key, getattr(defaults, key)) for key in keys}
    options["num_kv_heads"] = m.get("num_kv_heads", 0) or None
    return options


def validate(
    config: ml_collections.ConfigDict, device_count: int | None = None, process_count: int = 1
) -> Plan:
    """Checks every part of a config before any compute; raises ValueError on the first problem.

    Checks the seed, the task and its options, the model (ModelConfig.validate, which checks
    the position scheme), the optimizer, the mesh against the device count, that batch
    sizes divide over the batch-sharded mesh axes and the processes, and (tracing the model,
    no compute) that the mesh axes divide every sharded parameter dimension and that the
    position scheme takes every evaluation split's sequence length.
    """
    device_count = jax.device_count() if device_count is None else device_count
    if not isinstance(config.seed, int) or not 0 <= config.seed < 2**31:
        raise ValueError(f"seed must be an integer in [0, 2**31), got {config.seed!r}")
    task = make_task(config.task.name, config.task.options.to_dict())
    cfg = model_config(config, task).validate()
    optim.validate(config.train)
    if config.train.nonfinite not in NONFINITE:
        raise ValueError(
            f"train.nonfinite must be one of {NONFINITE}, got {config.train.nonfinite!r}"
        )
    shape = sharding.mesh_shape(
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor, device_count
    )
    rules = sharding.rules_tuple(config.axis_rules)
    batch_axes = nn.logical_to_mesh_axes((sharding.BATCH,), rules)[0] or ()
    batch_axes = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,)
    ways = int(np.prod([dict(zip(sharding.MESH_AXES, shape, strict=True))[a] for a in batch_axes]))
    ways = int(np.lcm(ways, process_count))
    for key in ("train.batch_size", "eval.batch_size"):
        size = config.train.batch_size if key.startswith("train") else config.eval.batch_size
        if not isinstance(size, int) or size <= 0 or size % ways:
            raise ValueError(
                f"{key}={size!r} must be a positive multiple of {ways} (the mesh axes "
                f"{batch_axes} that shard the batch, and the {process_count} processes)"
            )
    splits = task.splits()
    eval_splits = tuple(config.eval.splits) or tuple(s for s in splits if s != "train")
    unknown = [s for s in eval_splits if s not in splits]
    if unknown:
        raise ValueError(f"eval.splits {unknown} unknown to task {task.name!r}: {sorted(splits)}")
    if not isinstance(config.eval.max_examples, int) or config.eval.max_examples < 0:
        raise ValueError(f"eval.max_examples must be >= 0, got {config.eval.max_examples!r}")
    if not isinstance(config.data.worker_count, int) or config.data.worker_count < 0:
        raise ValueError(f"data.worker_count must be >= 0, got {config.data.worker_count!r}")
    # Last, as they trace the model: shapes against the mesh, split lengths against tables.
    params = shape_checks.abstract_params(cfg, task.seq_len)
    shape_checks.check_divisible(params, dict(zip(sharding.MESH_AXES, shape, strict=True)), rules)
    lengths = {s: shape_checks.split_length(task, s, config.seed) for s in eval_splits}
    shape_checks.check_lengths(cfg, {**lengths, "train": task.seq_len}, params)
    return Plan(task=task, model_config=cfg, mesh_shape=shape, eval_splits=eval_splits)


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
    mesh = sharding.make_mesh(*plan.mesh_shape)
    rules = sharding.rules_tuple(config.axis_rules)
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
    batch_ways = plan.mesh_shape[0] * plan.mesh_shape[1]
    steps = make_steps(
        model, train, config.seed, (batch_ways, plan.task.seq_len), mesh=mesh, rules=rules
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

    def check_config(step: int, saved: dict[str, Any]) -> None:
        if not workdir.same_run(saved, resolved):
            diffs = "\n  ".join(workdir.config_differences(saved, resolved)[:20])
            raise workdir.WorkdirConflictError(
                f"checkpoint {step} in {root} was written by a different config:\n  {diffs}\n"
                "Pass --restart to discard it and start over."
            )

    host: dict[str, float] = {"loss_sum": 0.0, "grad_norm_sum": 0.0, "count": 0.0}
    restored = ckpt.restore_latest(steps.abstract_state, data, check_config)
    if restored is None:
        state, start = steps.init(), 0
    else:
        start, state, saved_host = restored
        host = saved_host or host
        print(f"resumed from checkpoint {start} in {root / 'checkpoints'}", flush=True)
    if main_process:  # a resumed run re-does the steps after its checkpoint
        truncate_after(root / "metrics.jsonl", start)
        truncate_events_after(root / "tb", start)

    writer = MetricsWriter(root, enabled=main_process)  # after truncate_after: it appends
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
            where = f"checkpoint {last_saved}" if last_saved else "none saved yet"
            raise NonFiniteLossError(
                f"the train state at step {step} holds non-finite values, so it was not "
                f"saved; last good checkpoint: {where} in {root / 'checkpoints'}"
            )
        ckpt.save(step, state, data, resolved, host)

    for step in range(start + 1, train.steps + 1):
        state, out = steps.train(state, _global_batch(next(data), steps.batch_sharding))
        out = jax.device_get(out)
        if not out["finite"]:
            if train.nonfinite == "stop":
                ckpt.wait()
                where = f"checkpoint {last_saved}" if last_saved else "none saved yet"
                raise NonFiniteLossError(
                    f"non-finite loss ({float(out['loss'])}) or gradient norm "
                    f"({float(out['grad_norm'])}) at step {step}; the state was not updated "
                    f"and nothing was saved; last good checkpoint: {where} in "
                    f"{root / 'checkpoints'} (re-run with --config.train.nonfinite=skip to resume "
                    "from it skipping such batches)"
                )
            window_skipped += 1
        else:
            host["loss_sum"] += float(out["loss"])
            host["grad_norm_sum"] += float(out["grad_norm"])
            host["count"] += 1
        record: dict[str, float] = {}
        if train.log_every and (step % train.log_every == 0 or step == train.steps):
            speed = progress.update(step)
            # A window whose steps were all skipped has no loss: NaN, written as JSON null and
            # left out of TensorBoard (never 0, which would look like a perfect fit).
            count = host["count"] or float("nan")
            record.update(
                {
                    "train/loss": host["loss_sum"] / count,
                    "train/grad_norm": host["grad_norm_sum"] / count,
                    "train/learning_rate": float(out["learning_rate"]),
                    "train/nonfinite_steps": float(state.nonfinite_count),
                    **speed,
                }
            )
            progress.print(step, record, skipped=window_skipped)
            host = {"loss_sum": 0.0, "grad_norm_sum": 0.0, "count": 0.0}
            window_skipped = 0
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

"""Runs tiny_copy training in a subprocess: ``python -m tests.train.run_tiny WORKDIR JSON``.

JSON holds ``{"position", "train", "mesh", "model", "eval", "data", "distributed": [addr, n, i],
"kill_during_save": step, "stop_after": [step or null per workdir], "train_by_workdir": [{...}
per workdir]}`` (all optional);
``kill_during_save`` SIGKILLs the process as soon as the asynchronous save of that step has
started (its files are still being written). WORKDIR may be a comma-separated list: the same
config runs in each (``stop_after`` ends the runs it names after that step, as
``train.run(stop_after=...)`` does; ``train_by_workdir`` overrides train keys per run).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")


def _die_during_save(kill_step: int) -> None:
    from copejax.runtime.checkpoint import Checkpointer

    save = Checkpointer.save

    def save_then_die(self: Checkpointer, step: int, *args: object, **kwargs: object) -> None:
        save(self, step, *args, **kwargs)
        if step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    Checkpointer.save = save_then_die


def main() -> None:
    workdir, spec = sys.argv[1], json.loads(sys.argv[2])
    # grain's data workers read absl flags (copejax.main parses them; this runner has none)
    from absl import flags

    flags.FLAGS.mark_as_parsed()
    if spec.get("distributed"):
        address, count, index = spec["distributed"]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=address, num_processes=count, process_id=index
        )
    from copejax.training import train
    from tests.train.tiny_task import tiny_config

    if spec.get("kill_during_save") is not None:
        _die_during_save(int(spec["kill_during_save"]))

    config = tiny_config(spec.get("position", "rope"), **spec.get("train", {}))
    config.mesh.update(spec.get("mesh", {}))
    config.model.update(spec.get("model", {}))
    config.eval.update(spec.get("eval", {}))
    config.data.update(spec.get("data", {}))
    roots = workdir.split(",")
    stops = spec.get("stop_after") or [None] * len(roots)
    overrides = spec.get("train_by_workdir") or [{}] * len(roots)
    for root, stop, override in zip(roots, stops, overrides, strict=True):
        run_config = config.copy_and_resolve_references()  # runs share one process's start-up
        run_config.train.update(override)
        train.run(run_config, root, stop_after=stop)


if __name__ == "__main__":
    main()

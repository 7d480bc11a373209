"""Runs tiny_copy training in a subprocess: ``python -m tests.train.run_tiny WORKDIR JSON``.

JSON holds ``{"position", "train", "mesh", "model", "eval", "distributed": [addr, n, i],
"kill_during_save": step}`` (all optional); ``kill_during_save`` SIGKILLs the process as soon as
the asynchronous save of that step has started (its files are still being written). WORKDIR
may be a comma-separated list: the same config runs in each.
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
    for root in workdir.split(","):  # several runs share one process (and its start-up cost)
        train.run(config, root)


if __name__ == "__main__":
    main()

"""Runs tiny_copy training in a subprocess: ``python -m tests.train.run_tiny WORKDIR JSON``.

JSON holds ``{"position", "train", "mesh", "eval", "distributed": [addr, n, i]}`` (all
optional). WORKDIR may be a comma-separated list: the same config runs in each.
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")


def main() -> None:
    workdir, spec = sys.argv[1], json.loads(sys.argv[2])
    if spec.get("distributed"):
        address, count, index = spec["distributed"]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=address, num_processes=count, process_id=index
        )
    from copejax import train
    from tests.train.tiny_task import tiny_config

    config = tiny_config(spec.get("position", "rope"), **spec.get("train", {}))
    config.mesh.update(spec.get("mesh", {}))
    config.eval.update(spec.get("eval", {}))
    for root in workdir.split(","):  # several runs share one process (and its start-up cost)
        train.run(config, root)


if __name__ == "__main__":
    main()

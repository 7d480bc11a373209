"""The training program: flags only (a config file, a workdir), then ``copejax.train.run``.

    python -m copejax.main --config=configs/flipflop.py:smoke --workdir=/tmp/ff \
        [--config.train.steps=50] [--restart]

Several processes (one per host, or several on one machine) join with
``--coordinator_address=host:port --num_processes=N --process_id=i``; on a managed cluster
``--distributed`` lets ``jax.distributed.initialize`` read them from the environment.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/x.py:smoke")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
_RESTART = flags.DEFINE_bool(
    "restart", False, "Delete the workdir's previous run (checkpoints, metrics) and start over."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-process runs."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() with cluster auto-detection."
)
flags.mark_flags_as_required(["config", "workdir"])


def initialize_distributed() -> None:
    """Joins a multi-process run when the flags (or --distributed) ask for one."""
    import jax

    if _COORDINATOR.value is None and not _DISTRIBUTED.value:
        return
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        # CPU processes exchange collectives over gloo (measured with jax 0.10.2).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if _COORDINATOR.value is None:
        jax.distributed.initialize()
        return
    if _NUM_PROCESSES.value is None or _PROCESS_ID.value is None:
        raise app.UsageError("--coordinator_address needs --num_processes and --process_id")
    jax.distributed.initialize(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # orbax logs every file operation at INFO
    initialize_distributed()
    from copejax import train

    try:
        train.run(_CONFIG.value, _WORKDIR.value, restart=_RESTART.value)
    except (ValueError, train.NonFiniteLossError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)

"""The machinery of a run: mesh and logical-axis sharding, checkpoints, the workdir and its lock,
metrics, preemption, progress and peer processes."""

"""Tasks and data pipelines: one module per task, registered by name."""

"""The parallel dims and the fixed order that composes them (parallelize.py): data, tensor, context,
expert and pipeline parallelism, and activation checkpointing."""

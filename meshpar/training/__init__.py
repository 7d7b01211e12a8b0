"""The training step and what surrounds it: step, optimizer, metrics, non-finite handling, checks before launch."""

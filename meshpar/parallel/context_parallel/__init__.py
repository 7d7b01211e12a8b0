"""Context parallelism: the sequence split and the all-gather attention (apply), the ring attention (ring)."""

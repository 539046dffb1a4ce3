"""Parallelism: one DiT forward on several GPUs (CFG rows or Ulysses sequence split), worker processes, the node."""

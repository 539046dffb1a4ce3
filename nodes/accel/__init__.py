"""Acceleration: cache-dit caching and compile nodes; the quantization engine the DiT loaders call."""

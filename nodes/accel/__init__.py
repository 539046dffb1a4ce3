"""Acceleration per sampling run: cache-dit caching and regional compile, their nodes and wrappers."""

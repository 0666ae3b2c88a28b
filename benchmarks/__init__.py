"""Benchmarks: one script per paper table; run as ``python -m benchmarks.NAME``."""

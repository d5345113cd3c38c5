"""Checkpoint writers for tests, benchmarks and the default server (``python -m model.testing``)."""

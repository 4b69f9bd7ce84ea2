"""Evaluation suite: datasets, eval runner, reports, benchmarks."""

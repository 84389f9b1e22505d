"""Smoke tests of the benchmark scripts in benchmarks/."""

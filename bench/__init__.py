"""Benchmarks (not tests): each compares side by side in one run; results go to BENCHMARKS.md."""

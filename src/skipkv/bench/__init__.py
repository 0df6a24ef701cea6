"""Benchmarks: they print a table and write JSON; they are not tests. See docs/benchmarks.md."""

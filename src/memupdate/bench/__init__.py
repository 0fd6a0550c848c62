"""Benchmarks (``memupdate bench ...``): each prints a table and writes JSON; they are not timed tests."""

"""Reproducible benchmarks; each runs alone, prints a table and writes JSON."""

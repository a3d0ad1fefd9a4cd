"""Discrete-event simulator: every policy over the same failure traces, samples and downtime."""

"""Pitstop worker agent: runs beside a node's trainers; imports nothing from Django."""

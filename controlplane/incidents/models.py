"""Database models of incidents (none yet): failures, recovery decisions, timeline events."""

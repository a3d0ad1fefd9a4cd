"""Database models of jobs (none yet)."""

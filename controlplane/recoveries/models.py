"""Database models of recoveries (none yet)."""

"""Migrations of the jobs app."""

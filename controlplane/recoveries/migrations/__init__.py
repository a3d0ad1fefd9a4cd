"""Migrations of the recoveries app."""

"""Whole-stack tests: real server processes on loopback."""

"""Simulation sweeps: the core's simulator over many seeds × policies, as parallel Celery tasks."""

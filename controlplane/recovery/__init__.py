"""Pitstop's recovery core: cost model, planner, restorer, policies and simulator (pure Python)."""

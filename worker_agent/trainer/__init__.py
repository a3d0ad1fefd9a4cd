"""Reference elastic trainer driven by the worker agent."""

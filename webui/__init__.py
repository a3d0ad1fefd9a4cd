"""Web UI: server-rendered dashboard pages, Plotly charts and live updates (Django app)."""

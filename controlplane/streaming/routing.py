"""Websocket routes served by Channels.

Agents authenticate with their job's token in ``hello`` and send no browser ``Origin``, so their
route sits outside the origin check; browser routes (the dashboard's) sit inside it, behind the
session.
"""

from django.urls import URLPattern, URLResolver, path

from controlplane.streaming.agent import AgentConsumer
from controlplane.streaming.dashboard import DashboardConsumer

agent_urlpatterns: list[URLPattern | URLResolver] = [
    path("ws/agent/", AgentConsumer.as_asgi()),
]
browser_urlpatterns: list[URLPattern | URLResolver] = [
    path("ws/dashboard/jobs/<int:job_id>/", DashboardConsumer.as_asgi()),
]

"""ASGI entry point `controlplane.asgi:application`: Django over HTTP, Channels for websockets."""

import gc
import os
import threading

from django.core.asgi import get_asgi_application

from controlplane import defaults

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# A serving process: it keeps the generated key and starts (or reuses) the embedded Redis where
# the environment sets neither, before get_asgi_application() reads the settings.
defaults.provide(redis=True)

# Set up Django (settings, apps) before anything imports models through the routing.
django_application = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import re_path  # noqa: E402

from controlplane.incidents import tasks  # noqa: E402
from controlplane.streaming import transport  # noqa: E402
from controlplane.streaming.routing import agent_urlpatterns, browser_urlpatterns  # noqa: E402

# Daphne closes a websocket it fails (a message over its size limit) with a code, not a reset.
transport.close_failed_connections()

# The first failure's planning is queued from here: its publish's one-time costs are paid now,
# beside the start, not in the middle of the burst of losses that records it.
threading.Thread(target=tasks.warm_publishing, name="warm-publishing", daemon=True).start()

# Garbage collection for a process that holds thousands of sockets: the objects made while
# starting are frozen out of every collection, and young objects are collected 50,000 at a time
# rather than 700, so that few of the objects a heartbeat makes live long enough to reach the
# old generation. A full collection of that generation held every heartbeat 0.3 to 0.8 s at
# 2,048 agents on a 2-core machine, twice a second once a backlog had formed (docs/architecture.md).
GC_THRESHOLDS = (50_000, 20, 100)
gc.collect()
gc.freeze()
gc.set_threshold(*GC_THRESHOLDS)

browsers = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(browser_urlpatterns)))
application = ProtocolTypeRouter(
    {
        "http": django_application,
        # agents first (token in hello, no Origin), then everything else behind the origin check
        "websocket": URLRouter([*agent_urlpatterns, re_path(r"", browsers)]),
    }
)

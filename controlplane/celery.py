"""Celery application of the control plane: broker and result backend on REDIS_URL, every key
under the deployment's prefix (``CELERY_*_TRANSPORT_OPTIONS`` in the settings). It has no
periodic task: the failure detector (``manage.py detect_failures``) does the periodic work."""

import os
from typing import Any

from celery import Celery
from celery.signals import worker_init
from django.conf import settings

from controlplane import defaults

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
# Every CELERY_* Django setting configures the app (CELERY_BROKER_URL -> broker_url, ...).
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_configure.connect
def _provide_defaults(**kwargs: Any) -> None:
    """Provide the embedded Redis to a Celery command (worker, beat, ...) that needs one.

    `celery -A controlplane worker` reads this app's configuration before anything else loads
    Django's settings, so this is the moment to publish REDIS_URL. A process that loaded the
    settings first (the ASGI server, manage.py, the tests) made its own choice already, and
    starting a server now would not reach its settings.
    """
    if not settings.configured:
        defaults.provide(redis=True)


@worker_init.connect
def _load_the_planner(**kwargs: Any) -> None:
    """Import now what the planner loads on its first placement (scipy's assignment solver):
    0.4 s of a worker's first decision at 16,384 devices, when a job has just lost a node."""
    import scipy.optimize  # noqa: F401

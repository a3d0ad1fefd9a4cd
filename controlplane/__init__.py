"""Pitstop control plane (a Django project); exposes the Celery app lazily as `celery_app`.

The app is looked up on first access rather than imported here, so that importing the pure
recovery core (`controlplane.recovery`) never pulls in Celery or Django.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["celery_app"]


def __getattr__(name: str) -> Celery:
    if name == "celery_app":
        from controlplane.celery import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

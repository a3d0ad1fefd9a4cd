"""Django app configuration of streaming."""

from django.apps import AppConfig


class StreamingConfig(AppConfig):
    name = "controlplane.streaming"
    label = "streaming"

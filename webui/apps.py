"""Django app configuration of the web UI."""

from django.apps import AppConfig


class WebuiConfig(AppConfig):
    name = "webui"

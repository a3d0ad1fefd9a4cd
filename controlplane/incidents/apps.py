"""Django app configuration of incidents."""

from django.apps import AppConfig


class IncidentsConfig(AppConfig):
    name = "controlplane.incidents"
    label = "incidents"
    default_auto_field = "django.db.models.BigAutoField"

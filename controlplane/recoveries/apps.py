"""Django app configuration of recoveries."""

from django.apps import AppConfig


class RecoveriesConfig(AppConfig):
    name = "controlplane.recoveries"
    label = "recoveries"
    default_auto_field = "django.db.models.BigAutoField"

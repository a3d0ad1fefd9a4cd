"""Django app configuration of simulations."""

from django.apps import AppConfig


class SimulationsConfig(AppConfig):
    name = "controlplane.simulations"
    label = "simulations"
    default_auto_field = "django.db.models.BigAutoField"

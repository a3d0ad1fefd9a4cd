"""Django admin of simulation sweeps (read-only: they are started through the API)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from controlplane.simulations.models import Sweep


@admin.register(Sweep)
class SweepAdmin(admin.ModelAdmin):
    list_display = ("pk", "name", "job", "status", "pieces_done", "pieces_total", "created_at")
    list_filter = ("status",)
    list_select_related = ("job",)
    search_fields = ("name", "job__name")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Sweep._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

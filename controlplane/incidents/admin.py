"""Django admin of failures, recovery decisions, their commands, drills and the timeline;
decisions, commands, drills and events change through their services only, so they are
read-only here."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from controlplane.incidents.models import (
    AgentCommand,
    Drill,
    Failure,
    RecoveryDecision,
    TimelineEvent,
)


@admin.register(Failure)
class FailureAdmin(admin.ModelAdmin):
    list_display = ("pk", "job", "kind", "devices", "source", "detected_at")
    list_filter = ("kind", "source")
    list_select_related = ("job",)
    search_fields = ("job__name",)


@admin.register(RecoveryDecision)
class RecoveryDecisionAdmin(admin.ModelAdmin):
    """Decisions change status through the state machine only, so every field is read-only."""

    list_display = ("pk", "job", "status", "failure", "chosen", "chosen_by", "created_at")
    list_filter = ("status",)
    list_select_related = ("job", "failure__job", "chosen_by")
    search_fields = ("job__name",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in RecoveryDecision._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(AgentCommand)
class AgentCommandAdmin(admin.ModelAdmin):
    list_display = ("created_at", "decision", "node", "action", "sends", "acked_at", "ok")
    list_filter = ("action", "ok")
    list_select_related = ("decision__job", "node__job")
    search_fields = ("node__job__name", "node__name")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in AgentCommand._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(Drill)
class DrillAdmin(admin.ModelAdmin):
    """Sent through the API or the job page (``incidents.drills``), never from here."""

    list_display = ("created_at", "job", "node", "kind", "device", "requested_by", "acked_at", "ok")
    list_filter = ("kind", "ok")
    list_select_related = ("job", "node__job")
    search_fields = ("job__name", "node__name", "requested_by")

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in Drill._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False


@admin.register(TimelineEvent)
class TimelineEventAdmin(admin.ModelAdmin):
    """Append-only: nothing here can be added, changed or deleted."""

    list_display = ("at", "job", "kind", "actor", "decision", "failure")
    list_filter = ("kind",)
    list_select_related = ("job", "decision__job", "failure__job")
    search_fields = ("job__name", "actor")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

"""Django admin of jobs, nodes, devices and agent tokens (list views join what they show)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.jobs.models import AgentToken, Device, Job, Node


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("name", "status", "approval_mode", "step", "created_at")
    list_filter = ("status", "approval_mode")
    search_fields = ("name",)
    readonly_fields = ("created_at", "updated_at")


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "job", "index", "status", "expected_at", "joined_at")
    list_filter = ("status",)
    list_select_related = ("job",)
    search_fields = ("name", "job__name")


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("index", "job", "node", "state")
    list_filter = ("state",)
    list_select_related = ("job", "node__job")
    search_fields = ("job__name",)


@admin.action(description="Revoke the selected tokens (their agents' sockets close)")
def revoke(modeladmin: AgentTokenAdmin, request: HttpRequest, tokens: QuerySet[AgentToken]) -> None:
    revoked = 0
    for token in tokens.filter(revoked_at__isnull=True).select_related("job", "node"):
        token.revoke()
        revoked += 1
    modeladmin.message_user(request, f"{revoked} token(s) revoked.")


@admin.register(AgentToken)
class AgentTokenAdmin(admin.ModelAdmin):
    """Tokens are issued with their job (the API shows the token once); here they are revoked,
    by the action only (``AgentToken.revoke``: an edited date would leave sockets open)."""

    list_display = ("job", "node", "created_at", "revoked_at")
    list_filter = ("revoked_at",)
    list_select_related = ("job", "node")
    readonly_fields = ("job", "node", "digest", "created_at", "revoked_at")
    actions = (revoke,)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

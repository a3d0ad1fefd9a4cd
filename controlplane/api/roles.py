"""Who may do what: the roles viewer (read), operator (approve, override) and admin (everything).

A role is a Django group of that name (created by a migration); a superuser is an admin. A user
with no role sees nothing.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from django.conf import settings
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request


class Role(IntEnum):
    NONE = 0
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3


ROLE_GROUPS = {"viewer": Role.VIEWER, "operator": Role.OPERATOR, "admin": Role.ADMIN}


def role_of(user: Any) -> Role:
    if user is None or not user.is_authenticated:
        return Role.NONE
    if user.is_superuser:
        return Role.ADMIN
    names = set(user.groups.values_list("name", flat=True))
    return max((ROLE_GROUPS[n] for n in names if n in ROLE_GROUPS), default=Role.NONE)


class _AtLeast(BasePermission):
    needed = Role.ADMIN
    message = "this needs a role the user does not have"

    def has_permission(self, request: Request, view: Any) -> bool:
        return role_of(request.user) >= self.needed


class CanRead(_AtLeast):
    """Any role reads; writes are checked by the view's own permission."""

    needed = Role.VIEWER
    message = "reading needs the viewer, operator or admin role"


class CanOperate(_AtLeast):
    needed = Role.OPERATOR
    message = "approving and overriding need the operator or admin role"


class CanAdminister(_AtLeast):
    needed = Role.ADMIN
    message = "this needs the admin role"


class ReadOrAdminister(BasePermission):
    """Viewers read, admins also write (create jobs)."""

    message = "creating or changing this needs the admin role"

    def has_permission(self, request: Request, view: Any) -> bool:
        needed = Role.VIEWER if request.method in SAFE_METHODS else Role.ADMIN
        return role_of(request.user) >= needed


class SchemaAccess(BasePermission):
    """The OpenAPI schema and its docs: public, or for any role where the deployment says so
    (``PITSTOP_SCHEMA_LOGIN``)."""

    message = "the API schema needs the viewer, operator or admin role here"

    def has_permission(self, request: Request, view: Any) -> bool:
        return not settings.PITSTOP_SCHEMA_LOGIN or role_of(request.user) >= Role.VIEWER

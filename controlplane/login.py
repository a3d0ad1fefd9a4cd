"""Logging in (the dashboard's and the admin's): Django's forms, with a throttle on wrong
passwords per user name and address, counted in the shared cache (Redis) so that every server
process sees one count."""

from __future__ import annotations

import hashlib
from typing import Any

import structlog
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache
from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.http import HttpResponse
from redis.exceptions import RedisError

log = structlog.get_logger(__name__)

# An address may try this many times the per-user limit, over every user name it tries.
ADDRESS_FACTOR = 4


class LoginThrottle:
    """Wrong passwords in a fixed window: per (user name, address) and per address."""

    def __init__(self, username: str, address: str) -> None:
        digest = hashlib.sha256(f"{username}\0{address}".encode()).hexdigest()[:32]
        self.limits = {
            f"login-fail:pair:{digest}": settings.PITSTOP_LOGIN_ATTEMPTS,
            f"login-fail:addr:{address}": settings.PITSTOP_LOGIN_ATTEMPTS * ADDRESS_FACTOR,
        }

    def refused(self) -> bool:
        try:
            counts = cache.get_many(list(self.limits))
        except RedisError as exc:  # logging in goes on without Redis; the refusal is logged
            log.warning("login.throttle_unavailable", error=str(exc))
            return False
        return any(counts.get(key, 0) >= limit for key, limit in self.limits.items())

    def failed(self) -> None:
        window_s = settings.PITSTOP_LOGIN_WINDOW_S
        try:
            for key in self.limits:
                cache.add(key, 0, timeout=window_s)  # the window starts at the first failure
                try:
                    cache.incr(key)
                except ValueError:  # expired between the two calls: a new window
                    cache.set(key, 1, timeout=window_s)
        except RedisError as exc:
            log.warning("login.throttle_unavailable", error=str(exc))


class ThrottledLogin:
    """A mixin for Django's authentication forms: refuses before checking the password once
    the limit is reached, and counts each wrong one."""

    request: Any
    cleaned_data: dict[str, Any]

    def clean(self) -> dict[str, Any]:
        address = str(self.request.META.get("REMOTE_ADDR", "")) if self.request else ""
        throttle = LoginThrottle(str(self.cleaned_data.get("username", "")), address)
        if throttle.refused():
            minutes = max(1, round(settings.PITSTOP_LOGIN_WINDOW_S / 60))
            raise ValidationError(
                "Too many wrong passwords for this user from this address: "
                "try again in %(minutes)d minutes.",
                code="throttled",
                params={"minutes": minutes},
            )
        try:
            found: dict[str, Any] = super().clean()  # type: ignore[misc]
        except ValidationError as exc:
            if getattr(exc, "code", None) == "invalid_login":
                throttle.failed()
            raise
        return found


class LoginForm(ThrottledLogin, AuthenticationForm):
    pass


class AdminLoginForm(ThrottledLogin, AdminAuthenticationForm):
    pass


class LoginView(auth_views.LoginView):
    """Django's login view with the throttled form; a refusal is a 429."""

    form_class = LoginForm

    def form_invalid(self, form: Any) -> HttpResponse:
        throttled = form.has_error(NON_FIELD_ERRORS, "throttled")
        response = self.render_to_response(self.get_context_data(form=form, throttled=throttled))
        response.status_code = 429 if throttled else 200
        return response

"""Top-level URL routes: health check, REST API with its OpenAPI schema, admin, login, web UI."""

from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from controlplane.api.errors import page_not_found
from controlplane.health import healthz
from controlplane.login import AdminLoginForm, LoginView
from controlplane.metrics import metrics

admin.site.login_form = AdminLoginForm
handler404 = page_not_found

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("api/", include("controlplane.api.urls")),
    path("admin/", admin.site.urls),
    path("accounts/login/", LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("webui.urls")),
]

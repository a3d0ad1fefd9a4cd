"""Top-level URL routes: health check, REST API with its OpenAPI schema, admin, web UI."""

from django.contrib import admin
from django.urls import include, path

from controlplane.health import healthz
from controlplane.metrics import metrics

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("api/", include("controlplane.api.urls")),
    path("admin/", admin.site.urls),
    path("", include("webui.urls")),
]

"""REST API routes: v1 under /api/v1/, with its OpenAPI schema, Swagger UI and Redoc (their files
from the pinned drf-spectacular-sidecar package, served by the app itself)."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from controlplane.api import views
from controlplane.api.roles import SchemaAccess

app_name = "api"

router = DefaultRouter()
router.register("jobs", views.JobViewSet, basename="job")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("devices", views.DeviceViewSet, basename="device")
router.register("failures", views.FailureViewSet, basename="failure")
router.register("recoveries", views.RecoveryViewSet, basename="recovery")
router.register("simulations", views.SweepViewSet, basename="simulation")

schema = SpectacularAPIView.as_view(permission_classes=[SchemaAccess])
urlpatterns = [
    path("schema/", schema, name="schema"),
    path("v1/schema/", schema, name="schema-v1"),
    path(
        "v1/docs/",
        SpectacularSwaggerView.as_view(url_name="api:schema-v1", permission_classes=[SchemaAccess]),
        name="docs",
    ),
    path(
        "v1/redoc/",
        SpectacularRedocView.as_view(
            url_name="api:schema-v1",
            permission_classes=[SchemaAccess],
            template_name="webui/redoc.html",  # no web fonts from another host
        ),
        name="redoc",
    ),
    path("v1/policies/", views.policies, name="policies"),
    path("v1/", include(router.urls)),
]

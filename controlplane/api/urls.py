"""REST API routes: v1 under /api/v1/ (with its OpenAPI schema and Swagger UI)."""

from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from controlplane.api import views

app_name = "api"

router = DefaultRouter()
router.register("jobs", views.JobViewSet, basename="job")
router.register("nodes", views.NodeViewSet, basename="node")
router.register("devices", views.DeviceViewSet, basename="device")
router.register("failures", views.FailureViewSet, basename="failure")
router.register("recoveries", views.RecoveryViewSet, basename="recovery")
router.register("simulations", views.SweepViewSet, basename="simulation")

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("v1/schema/", SpectacularAPIView.as_view(), name="schema-v1"),
    path("v1/docs/", SpectacularSwaggerView.as_view(url_name="api:schema-v1"), name="docs"),
    path("v1/policies/", views.policies, name="policies"),
    path("v1/", include(router.urls)),
]

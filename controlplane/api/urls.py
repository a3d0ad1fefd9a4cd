"""REST API routes under /api/: the OpenAPI schema now, resource routers as they arrive."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView

app_name = "api"

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
]

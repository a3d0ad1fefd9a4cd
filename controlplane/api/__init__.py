"""REST API: DRF serializers, views and routers, and the OpenAPI schema."""

"""The OpenAPI schema says every status the API answers: a postprocessing hook of drf-spectacular
adds the errors every operation can give (``controlplane.api.errors``' one shape) and the
Retry-After header of a 429, the views declare their own (409, 429, 503)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse

from controlplane.api.serializers import ErrorSerializer

ERROR_REF = {"$ref": "#/components/schemas/Error"}
ERROR_FIELDS = ("code", "message", "field")

# Every operation: 403 without a role that may call it, 404 for an unknown id, page or
# ``?format``. Operations that take a query parameter or a body: 400 when one is invalid.
EVERYWHERE = {"403": "no role that may do this", "404": "no such object, page or format"}
INVALID = {"400": "an invalid parameter or body; `field` names it"}


def error(description: str) -> OpenApiResponse:
    """An error response of the one shape, for a view's ``extend_schema(responses=...)``."""
    return OpenApiResponse(ErrorSerializer, description=description)


RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds until the call is served again",
        "schema": {"type": "integer"},
    }
}


def add_error_responses(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the common errors on every operation."""
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault(
        "Error",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "message": {"type": "string"},
                "field": {"type": "string", "nullable": True},
            },
            "required": list(ERROR_FIELDS),
        },
    )
    for methods in result.get("paths", {}).values():
        for operation in methods.values():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            takes = "requestBody" in operation or any(
                p.get("in") == "query" for p in operation.get("parameters", [])
            )
            content: dict[str, Any] = {"application/json": {"schema": ERROR_REF}}
            for ok in operation["responses"].values():
                if "text/csv" in ok.get("content", {}):  # an export's errors come as CSV too
                    content["text/csv"] = {"schema": {"type": "string"}}
            codes = {**EVERYWHERE, **(INVALID if takes else {})}
            for code, description in codes.items():
                operation["responses"].setdefault(
                    code, {"description": description, "content": content}
                )
            if "429" in operation["responses"]:  # throttled (controlplane.api.throttles)
                operation["responses"]["429"].setdefault("headers", RETRY_AFTER)
    return result


THROTTLED = error("throttled: too many of these calls by this user; Retry-After says when again")


def query(name: str, kind: type, description: str, enum: list[str] | None = None) -> Any:
    """A documented query parameter of a list or an export."""
    return OpenApiParameter(name, kind, OpenApiParameter.QUERY, description=description, enum=enum)

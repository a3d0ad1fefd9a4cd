"""structlog configuration shared by Django's logging: key-value events as JSON or console lines."""

import logging.config
import os
import re
from collections.abc import MutableMapping
from typing import Any

import structlog

LOG_FORMATS = ("json", "console")

# Fields whose values never reach a log line, whoever logs them: tokens, keys, passwords,
# credentials. A name ending in "key" is one (key, api_key, apikey, private_key, ssh-key);
# "keys" or "key_id" is not.
SECRET_FIELD = re.compile(
    r"token|secret|passw(or)?d|authorization|cookie|credential|key$", re.IGNORECASE
)
REDACTED = "[redacted]"


def redact_secrets(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: the value of every field named like a secret becomes ``REDACTED``."""
    for key in event:
        if key != "event" and SECRET_FIELD.search(key):
            event[key] = REDACTED
    return event


_SHARED_PROCESSORS: list[structlog.types.Processor] = [
    structlog.contextvars.merge_contextvars,
    redact_secrets,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure(*, log_format: str, level: str) -> None:
    """Route structlog and standard logging through one structured formatter, from now on.

    Applied at once rather than by Django's setup, so that events logged before Django starts
    (the embedded Redis starting, see `controlplane.defaults`) are formatted like every later one.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"LOG_FORMAT must be one of {LOG_FORMATS}, not {log_format!r}")
    structlog.configure(
        processors=[
            *_SHARED_PROCESSORS,
            structlog.stdlib.filter_by_level,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {
                "structured": {
                    "()": structlog.stdlib.ProcessorFormatter,
                    "processors": [
                        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.format_exc_info,
                        renderer,
                    ],
                    # Records of plain `logging` users (Django, Celery, Daphne) get these fields.
                    "foreign_pre_chain": _SHARED_PROCESSORS,
                }
            },
            "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "structured"}},
            "root": {"handlers": ["console"], "level": level},
        }
    )


def configure_from_environment() -> None:
    """`configure` from LOG_FORMAT and LOG_LEVEL (README "Configuration"): console, INFO."""
    configure(
        log_format=os.environ.get("LOG_FORMAT") or "console",
        level=os.environ.get("LOG_LEVEL") or "INFO",
    )

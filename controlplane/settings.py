"""Django settings, read once from the environment (see README "Configuration").

Importing this module writes no file and starts no process: the generated SECRET_KEY and the
embedded Redis are provided, when the environment leaves them unset, by the processes that need
them (`controlplane.defaults`), before Django reads these settings.
"""

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import environ
import redis.connection
from django.core.exceptions import ImproperlyConfigured

from controlplane import defaults, https, structured_logging

env = environ.Env()

# Everything the embedded defaults keep (SQLite file, embedded Redis, generated key) lives here.
DATA_DIR = defaults.data_dir()

DEBUG: bool = env.bool("DEBUG", default=False)
# Configured here, once, instead of through Django's LOGGING (see structured_logging).
LOGGING_CONFIG = None
structured_logging.configure_from_environment()

# Empty unless configured or provided: Django then refuses to sign anything, naming the setting.
SECRET_KEY: str = env.str("SECRET_KEY", default="")
ALLOWED_HOSTS: list[str] = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

# Behind a TLS-terminating proxy (docs/operations.md, "TLS"): the header and value it sets on the
# requests it received over https, "X-Forwarded-Proto: https". Those requests then count as https
# (CSRF's origin check, HSTS), and the session and CSRF cookies travel over https only.
_PROXY_SSL_HEADER = env.str("SECURE_PROXY_SSL_HEADER", default="")
SECURE_PROXY_SSL_HEADER = https.proxy_ssl_header(_PROXY_SSL_HEADER) if _PROXY_SSL_HEADER else None
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_PROXY_SSL_HEADER is not None
# Origins browsers POST from where they differ from the host the servers see (a proxy that
# rewrites Host or drops its port): "https://pitstop.example,https://*.example.com:8443".
CSRF_TRUSTED_ORIGINS = https.trusted_origins(env.list("CSRF_TRUSTED_ORIGINS", default=[]))
# HSTS on every response to an https request: browsers then use nothing else for this long.
SECURE_HSTS_SECONDS = https.seconds(
    env.str("SECURE_HSTS_SECONDS", default="31536000"), variable="SECURE_HSTS_SECONDS"
)

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{DATA_DIR / 'pitstop.sqlite3'}")
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default is written by several processes at once (the server, the detector,
    # Celery workers): the write-ahead log (switched on once per file, controlplane/sqlite.py)
    # lets readers go on while one writes, a writer takes its lock when its transaction begins
    # and waits up to 20 s for it instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        init_command="PRAGMA synchronous=NORMAL;",
        transaction_mode="IMMEDIATE",
        timeout=20,
    )
# A thread keeps its connection a minute rather than opening one for every call (``?conn_max_age=``
# in DATABASE_URL overrides it). On PostgreSQL a new connection costs a connect and its session's
# set-up: opened for each of the server's calls, they made one server answer 2,048 hellos after
# 12.5 s (median) instead of 0.5 s. A kept connection is checked before it is used again, so one
# the database dropped (a restart) is replaced rather than failing the call.
DATABASES["default"].setdefault("CONN_MAX_AGE", 60)
DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)

# What a process that does not serve (manage.py migrate, mypy) sees when REDIS_URL is unset: a
# host in the reserved .invalid domain, which never resolves, so a client that uses it anyway
# fails naming it. The processes that serve publish the embedded server's URL instead.
REDIS_NOT_PROVIDED = "redis://embedded-redis-not-started.invalid:6379/0"
REDIS_URL: str = env.str("REDIS_URL", default="") or REDIS_NOT_PROVIDED


def redis_prefix(namespace: str, redis_url: str) -> str:
    """What every Redis key and pub/sub channel of the deployment begins with, so that several
    deployments can share one Redis server: ``NAMESPACE:DB``. Keys are apart on different
    database numbers already, pub/sub channels are not: the number is part of the prefix, and
    deployments on one database tell themselves apart by their namespace (docs/operations.md,
    "Several deployments on one Redis server")."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", namespace):
        raise ImproperlyConfigured(
            f"PITSTOP_NAMESPACE={namespace!r}: 1 to 64 letters, digits, '_' or '-'"
        )
    try:
        db = int(redis.connection.parse_url(redis_url).get("db", 0))
    except ValueError as exc:
        raise ImproperlyConfigured(f"REDIS_URL: {exc}") from exc
    return f"{namespace}:{db}"


PITSTOP_NAMESPACE: str = env.str("PITSTOP_NAMESPACE", default="pitstop")
PITSTOP_REDIS_PREFIX = redis_prefix(PITSTOP_NAMESPACE, REDIS_URL)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "controlplane.jobs",
    "controlplane.incidents",
    "controlplane.simulations",
    "controlplane.api",
    "controlplane.streaming",
    "webui",
]

MIDDLEWARE = [
    "controlplane.request_context.request_context",
    "django.middleware.security.SecurityMiddleware",
    "controlplane.https.content_security_policy",
    # static files (the dashboard's CSS and JS, plotly.js) from the ASGI app: daphne serves none;
    # gzipped on the way out, each once (controlplane/static_files.py)
    "controlplane.static_files.compressed_static",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "webui.context.assets",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# WhiteNoise serves the files where the finders find them (the apps' static/ folders and
# plotly's own bundle, below), so nothing has to be collected first. `manage.py collectstatic`
# works where STATIC_ROOT is set, for a deployment that wants the files in one folder.
STATIC_ROOT: str | None = env.str("STATIC_ROOT", default="") or None
WHITENOISE_USE_FINDERS = True
_PLOTLY = importlib.util.find_spec("plotly")  # found, not imported
# plotly.js under a folder named for its package's version: a browser may keep it for good
# (WhiteNoise marks it immutable) and a new version is a new address.
PLOTLY_DIR = f"vendor/plotly-{importlib.metadata.version('plotly')}" if _PLOTLY else "vendor/plotly"
PLOTLY_JS = f"{PLOTLY_DIR}/plotly.min.js"
STATICFILES_DIRS = (
    [(PLOTLY_DIR, Path(_PLOTLY.origin).parent / "package_data")]
    if _PLOTLY is not None and _PLOTLY.origin is not None
    else []
)
WHITENOISE_IMMUTABLE_FILE_TEST = r"/vendor/plotly-[^/]+/"

# The dashboard's login (Django's auth views, webui templates).
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "webui:index"
LOGOUT_REDIRECT_URL = "login"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# No CHANNEL_LAYERS: the consumers use none. Commands reach an agent's socket through Redis
# pub/sub (controlplane/streaming/hub.py); the dashboard's socket only sends, from its own loop.

# Agents beat every interval; a node silent for MISSED_BEATS intervals has failed.
PITSTOP_HEARTBEAT_INTERVAL_S: float = env.float("PITSTOP_HEARTBEAT_INTERVAL_S", default=1.0)
PITSTOP_MISSED_BEATS: int = env.int("PITSTOP_MISSED_BEATS", default=3)
# A node expected in a job and not joined (no hello) this many seconds after it was expected
# has failed as ``never_joined``; a job none of whose nodes was heard for as long is ``stale``.
PITSTOP_JOIN_DEADLINE_S: float = env.float("PITSTOP_JOIN_DEADLINE_S", default=30.0)
# A decision whose agents have not all trained again this many seconds after the plan was sent
# fails, naming them.
PITSTOP_APPLY_TIMEOUT_S: float = env.float("PITSTOP_APPLY_TIMEOUT_S", default=120.0)
# An agent's socket that has not said hello this many seconds after it opened is closed; a
# server process holds at most this many such sockets at once (more are closed at once).
PITSTOP_HELLO_TIMEOUT_S: float = env.float("PITSTOP_HELLO_TIMEOUT_S", default=5.0)
# Unset, the cap is 256 or a quarter of the process's soft descriptor limit (RLIMIT_NOFILE) if
# that is smaller (controlplane.streaming.agent.default_waiting_cap); a value given here wins.
PITSTOP_MAX_WAITING_SOCKETS: int | None = env.int("PITSTOP_MAX_WAITING_SOCKETS", default=None)

# Read by controlplane.celery through the CELERY_ namespace.
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = TIME_ZONE
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Queues, bindings and results under the deployment's prefix: on a database shared with another
# deployment, neither's workers take the other's tasks.
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"{PITSTOP_REDIS_PREFIX}:celery:"}
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"global_keyprefix": f"{PITSTOP_REDIS_PREFIX}:celery:"}
CELERY_WORKER_HIJACK_ROOT_LOGGER = False  # keep the structured handler

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # browsers use the session (with CSRF); API clients send "Authorization: Token <key>"
    "DEFAULT_AUTHENTICATION_CLASSES": (
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.TokenAuthentication",
    ),
    "DEFAULT_PERMISSION_CLASSES": ("controlplane.api.roles.CanRead",),
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 100,
    "EXCEPTION_HANDLER": "controlplane.api.errors.exception_handler",
    # per-user limits on the calls whose cost the caller controls (controlplane.api.throttles)
    "DEFAULT_THROTTLE_CLASSES": ("controlplane.api.throttles.CostThrottle",),
}
# Per user, over a sliding window ("N/s", "N/min", "N/hour", "N/day"): what-if, creating jobs and
# agent tokens, starting simulation sweeps, sending drills. One call more is a 429 (Retry-After).


def api_rate(variable: str, value: str) -> str:
    """``value`` if it is a rate DRF reads ("N/s", "N/min", "N/hour", "N/day", N ≥ 1), else an
    error naming ``variable`` at start rather than a 500 on the first throttled call."""
    if not re.fullmatch(r"[1-9][0-9]{0,8}/(s|sec|second|m|min|minute|h|hour|d|day)", value):
        raise ImproperlyConfigured(f'{variable}={value!r}: a rate such as "60/min" or "1000/day"')
    return value


PITSTOP_API_RATE_WHATIF = api_rate(
    "PITSTOP_API_RATE_WHATIF", env.str("PITSTOP_API_RATE_WHATIF", default="60/min")
)
PITSTOP_API_RATE_JOBS = api_rate(
    "PITSTOP_API_RATE_JOBS", env.str("PITSTOP_API_RATE_JOBS", default="30/min")
)
# every node of a job launched by pitstop-run asks for its job once, all at the same moment
PITSTOP_API_RATE_LAUNCHES = api_rate(
    "PITSTOP_API_RATE_LAUNCHES", env.str("PITSTOP_API_RATE_LAUNCHES", default="1000/min")
)
PITSTOP_API_RATE_SIMULATIONS = api_rate(
    "PITSTOP_API_RATE_SIMULATIONS", env.str("PITSTOP_API_RATE_SIMULATIONS", default="20/min")
)
PITSTOP_API_RATE_DRILLS = api_rate(
    "PITSTOP_API_RATE_DRILLS", env.str("PITSTOP_API_RATE_DRILLS", default="30/min")
)
SPECTACULAR_SETTINGS = {
    "TITLE": "Pitstop control plane API",
    "DESCRIPTION": "Jobs, failures, recovery decisions and their timeline.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "controlplane.api.schema.add_error_responses",
    ],
    # Swagger UI and Redoc from the pinned drf-spectacular-sidecar package, never a CDN
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # bodies are documented as JSON, what scripts send (the browsable API's forms still work)
    "PARSER_WHITELIST": ["rest_framework.parsers.JSONParser"],
}

# What is public (docs/operations.md): a bearer token that /metrics requires (empty: none), and
# whether the OpenAPI schema and its docs need a login with a role (default: public).
PITSTOP_METRICS_TOKEN: str = env.str("PITSTOP_METRICS_TOKEN", default="")
# Webhooks told when a decision needs someone (a proposal waiting for approval, a job no policy
# can recover): JSON with a Slack-compatible ``text`` (controlplane/incidents/notifications.py);
# comma-separated, none by default. PITSTOP_PUBLIC_URL makes the links in them absolute.
PITSTOP_WEBHOOK_URLS: list[str] = env.list("PITSTOP_WEBHOOK_URLS", default=[])
PITSTOP_PUBLIC_URL: str = env.str("PITSTOP_PUBLIC_URL", default="")
PITSTOP_SCHEMA_LOGIN: bool = env.bool("PITSTOP_SCHEMA_LOGIN", default=False)
# Login throttle: at most this many wrong passwords per user and address (four times as many per
# address) in a window, counted in Redis so that every server process shares the count.
PITSTOP_LOGIN_ATTEMPTS: int = env.int("PITSTOP_LOGIN_ATTEMPTS", default=5)
PITSTOP_LOGIN_WINDOW_S: int = env.int("PITSTOP_LOGIN_WINDOW_S", default=300)
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": f"{PITSTOP_REDIS_PREFIX}:cache",
    }
}

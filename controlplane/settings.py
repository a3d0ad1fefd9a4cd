"""Django settings, read once from the environment (see README "Configuration").

Importing this module writes no file and starts no process: the generated SECRET_KEY and the
embedded Redis are provided, when the environment leaves them unset, by the processes that need
them (`controlplane.defaults`), before Django reads these settings.
"""

import importlib.util
from pathlib import Path

import environ

from controlplane import defaults, structured_logging

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

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{DATA_DIR / 'pitstop.sqlite3'}")
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The embedded default is written by several processes at once (the server, the detector,
    # Celery workers): the write-ahead log (switched on once per file, controlplane/sqlite.py)
    # lets readers go on while one writes, a writer takes its lock when its transaction begins
    # and waits up to 20 s for it instead of failing, and a thread keeps its connection a while
    # rather than opening the file for every call.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        init_command="PRAGMA synchronous=NORMAL;",
        transaction_mode="IMMEDIATE",
        timeout=20,
    )
    DATABASES["default"]["CONN_MAX_AGE"] = 60

# What a process that does not serve (manage.py migrate, mypy) sees when REDIS_URL is unset: a
# host in the reserved .invalid domain, which never resolves, so a client that uses it anyway
# fails naming it. The processes that serve publish the embedded server's URL instead.
REDIS_NOT_PROVIDED = "redis://embedded-redis-not-started.invalid:6379/0"
REDIS_URL: str = env.str("REDIS_URL", default="") or REDIS_NOT_PROVIDED

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
    # static files (the dashboard's CSS and JS, plotly.js) from the ASGI app: daphne serves none
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
STATICFILES_DIRS = (
    [("vendor/plotly", Path(_PLOTLY.origin).parent / "package_data")]
    if _PLOTLY is not None and _PLOTLY.origin is not None
    else []
)

# The dashboard's login (Django's auth views, webui templates).
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "webui:index"
LOGOUT_REDIRECT_URL = "login"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # redis-py 8 times a read out after 5 s, the length of the layer's blocking read: without
        # a longer timeout the layer's receive loop dies, and a socket with it, every ~5 s
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15}]},
    }
}

# Agents beat every interval; a node silent for MISSED_BEATS intervals has failed.
PITSTOP_HEARTBEAT_INTERVAL_S: float = env.float("PITSTOP_HEARTBEAT_INTERVAL_S", default=1.0)
PITSTOP_MISSED_BEATS: int = env.int("PITSTOP_MISSED_BEATS", default=3)
# A decision whose agents have not all trained again this many seconds after the plan was sent
# fails, naming them.
PITSTOP_APPLY_TIMEOUT_S: float = env.float("PITSTOP_APPLY_TIMEOUT_S", default=120.0)

# Read by controlplane.celery through the CELERY_ namespace.
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = TIME_ZONE
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
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
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Pitstop control plane API",
    "DESCRIPTION": "Jobs, failures, recovery decisions and their timeline.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
}

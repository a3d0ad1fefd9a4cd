"""Django settings, read once from the environment (see README "Configuration")."""

from pathlib import Path

import environ

from controlplane import embedded_redis, secret_key, structured_logging

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

# Everything the embedded defaults write (SQLite file, embedded Redis, generated key) lives here.
DATA_DIR = Path(env.str("PITSTOP_DATA_DIR", default=str(BASE_DIR / "var"))).resolve()

DEBUG: bool = env.bool("DEBUG", default=False)
# Configured here, once, instead of through Django's LOGGING (see structured_logging).
LOGGING_CONFIG = None
structured_logging.configure(
    log_format=env.str("LOG_FORMAT", default="console"),
    level=env.str("LOG_LEVEL", default="INFO"),
)

SECRET_KEY: str = env.str("SECRET_KEY", default="") or secret_key.load_or_create(
    DATA_DIR / "secret_key"
)
ALLOWED_HOSTS: list[str] = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

DATABASES = {
    "default": env.db_url("DATABASE_URL", default=f"sqlite:///{DATA_DIR / 'pitstop.sqlite3'}")
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # SQLite needs its folder; a PostgreSQL URL needs nothing here.
    DATA_DIR.mkdir(parents=True, exist_ok=True)

# Unset means "start (or reuse) the embedded server for DATA_DIR"; it stops when this process ends.
REDIS_URL: str = env.str("REDIS_URL", default="") or embedded_redis.default_url(DATA_DIR / "redis")

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
    "drf_spectacular",
    "controlplane.jobs",
    "controlplane.recoveries",
    "controlplane.api",
    "controlplane.streaming",
    "webui",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
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
STATIC_ROOT = DATA_DIR / "static"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL]},
    }
}

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
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Pitstop control plane API",
    "DESCRIPTION": "Jobs, failures, recovery decisions and their timeline.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
}

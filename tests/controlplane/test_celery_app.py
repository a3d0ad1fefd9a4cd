"""The Celery app is configured from Django settings and talks to REDIS_URL."""

from celery.app.utils import find_app
from django.conf import settings

from controlplane.celery import app


def test_broker_and_result_backend_are_redis_url() -> None:
    assert app.conf.broker_url == settings.REDIS_URL
    assert app.conf.result_backend == settings.REDIS_URL


def test_broker_and_result_backend_answer() -> None:
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1)
    assert app.backend.client.ping() is True


def test_celery_command_line_finds_the_app_in_the_project_package() -> None:
    # `celery -A controlplane worker` resolves the app this way.
    assert find_app("controlplane") is app


def test_package_exposes_the_celery_app() -> None:
    import controlplane

    assert controlplane.celery_app is app


def test_a_starting_worker_loads_the_planners_solver_before_its_first_decision() -> None:
    """A worker's first placement would otherwise import scipy's solver (0.4 s) while a job
    waits for its recovery; a fresh interpreter, since this one may have it already."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import django\n"
        "django.setup()\n"
        "from celery.signals import worker_init\n"
        "from controlplane.celery import app\n"
        "before = 'scipy.optimize' in sys.modules\n"
        "worker_init.send(sender=None)\n"
        "print(before, 'scipy.optimize' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"]

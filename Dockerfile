# Images for docker-compose.yml. The default (last) stage is the control plane's, for web, worker,
# beat, detector and migrate; `--target agent` is the worker agent's: the agent, the reference
# trainer on CPU torch and the recovery core's codec, without the control plane.
FROM python:3.11-slim AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
RUN useradd --create-home --uid 1000 pitstop

FROM base AS agent
COPY requirements-agent.txt .
RUN pip install -r requirements-agent.txt
COPY worker_agent/ worker_agent/
COPY controlplane/__init__.py controlplane/
COPY controlplane/recovery/ controlplane/recovery/
COPY examples/ examples/
USER pitstop
CMD ["python", "-m", "worker_agent", "--help"]

FROM base AS controlplane
COPY requirements.txt .
RUN pip install -r requirements.txt

COPY . .
RUN mkdir -p /app/var && chown pitstop /app/var
USER pitstop

EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "controlplane.asgi:application"]

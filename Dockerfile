# Image for every Pitstop service in docker-compose.yml (web, worker, beat, agent).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY requirements.txt .
RUN pip install -r requirements.txt

COPY . .
RUN useradd --create-home --uid 1000 pitstop && mkdir -p /app/var && chown pitstop /app/var
USER pitstop

EXPOSE 8000
CMD ["daphne", "-b", "0.0.0.0", "-p", "8000", "controlplane.asgi:application"]

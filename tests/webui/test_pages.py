"""The web UI's pages render."""

from django.test import Client


def test_landing_page_links_health_and_schema(client: Client) -> None:
    response = client.get("/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "Pitstop control plane" in page
    assert 'href="/healthz"' in page and 'href="/api/schema/"' in page

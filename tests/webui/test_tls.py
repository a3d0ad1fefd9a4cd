"""Behind a TLS-terminating proxy: the settings read from the environment, the content security
policy, and the documented deployment for real -- Debian's nginx terminating TLS on loopback
with a certificate made here, in front of the control plane in processes (tests/e2e/stack.py),
where Chromium logs in over https and approves a proposal, the dashboard's live updates arrive
over wss, and the simulated agents speak to the server over wss through the same proxy.

Needs /usr/sbin/nginx and /usr/bin/chromium: `./dev test` installs both (apt-get) when run as
root; elsewhere the end-to-end test is skipped, saying so.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st

from controlplane import https
from tests.e2e.stack import SCENARIO, Stack
from tests.processes import (
    REPO_ROOT,
    clean_environment,
    free_port,
    last_line,
    python_in_repo,
    wait_until,
)

CHROMIUM = Path("/usr/bin/chromium")
NGINX = Path("/usr/sbin/nginx")
PASSWORD = "tls-operator-pw-1"
HSTS_SECONDS = 600
TLS_ENVIRONMENT = {
    "SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto: https",
    "SECURE_HSTS_SECONDS": str(HSTS_SECONDS),
}

# --- the settings, parsed ------------------------------------------------------------------

header_names = st.from_regex(r"[A-Za-z0-9]{1,8}(-[A-Za-z0-9]{1,8}){0,3}", fullmatch=True)
header_values = st.from_regex(r"[!-~]{1,20}", fullmatch=True)


@given(name=header_names, value=header_values, space=st.sampled_from(["", " ", "  "]))
def test_a_proxy_header_reads_as_django_sees_it(name: str, value: str, space: str) -> None:
    parsed = https.proxy_ssl_header(f"{name}:{space}{value}")
    assert parsed == ("HTTP_" + name.upper().replace("-", "_"), value)


@pytest.mark.parametrize(
    "value",
    ["X-Forwarded-Proto", "HTTP_X_FORWARDED_PROTO: https", ": https", "X-Forwarded-Proto:",
     "X Forwarded: https", "X-Forwarded-Proto: ht tps", "-X: https", "X-Forwarded-Proto: é"],
)  # fmt: skip
def test_a_malformed_proxy_header_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^SECURE_PROXY_SSL_HEADER=.*X-Forwarded"):
        https.proxy_ssl_header(value)


hosts = st.from_regex(r"(\*\.)?[a-z0-9]{1,10}(\.[a-z0-9]{1,10}){0,2}", fullmatch=True)


@given(
    scheme=st.sampled_from(["http", "https", "HTTPS"]),
    host=hosts,
    port=st.none() | st.integers(1, 65535),
)
def test_trusted_origins_are_kept_as_origins(scheme: str, host: str, port: int | None) -> None:
    origin = f"{scheme}://{host.upper()}" + ("" if port is None else f":{port}")
    expected = f"{scheme.lower()}://{host}" + ("" if port is None else f":{port}")
    assert https.trusted_origins([f" {origin}", "", origin + "/"]) == [expected, expected]


@pytest.mark.parametrize(
    ("value", "why"),
    [("pitstop.example", "scheme"), ("ftp://pitstop.example", "scheme"),
     ("https://", "host"), ("https://user@pitstop.example", "host"),
     ("https://pitstop.example/dashboard", "path"), ("https://pitstop.example?x=1", "query"),
     ("https://pitstop.example:99999", "port"), ("https://pitstop.example:x", "port")],
)  # fmt: skip
def test_a_malformed_trusted_origin_is_refused_saying_why(value: str, why: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"^CSRF_TRUSTED_ORIGINS: '.*' .*{why}"):
        https.trusted_origins(["https://fine.example", value])


@pytest.mark.parametrize("value", ["-1", "1e3", "ten", "", "٣", "2147483648", "9" * 400])
def test_hsts_seconds_must_be_a_whole_number(value: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"^SECURE_HSTS_SECONDS=.*whole number"):
        https.seconds(value, variable="SECURE_HSTS_SECONDS")
    assert https.seconds(" 600 ", variable="SECURE_HSTS_SECONDS") == 600


_PROBE = """
import json
from controlplane import settings
print(json.dumps([settings.SECURE_PROXY_SSL_HEADER, settings.CSRF_TRUSTED_ORIGINS,
                  settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE,
                  settings.SECURE_HSTS_SECONDS]))
"""


def test_the_settings_read_the_proxy_from_the_environment() -> None:
    behind = clean_environment(
        **TLS_ENVIRONMENT, CSRF_TRUSTED_ORIGINS="https://pitstop.example,https://*.b.example:8443"
    )
    assert json.loads(last_line(python_in_repo("-c", _PROBE, env=behind))) == [
        ["HTTP_X_FORWARDED_PROTO", "https"],
        ["https://pitstop.example", "https://*.b.example:8443"],
        True,
        True,
        HSTS_SECONDS,
    ]
    # without a proxy: cookies over http too, HSTS (sent on https requests only) a year
    plain = json.loads(last_line(python_in_repo("-c", _PROBE, env=clean_environment())))
    assert plain == [None, [], False, False, 31536000]
    refused = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=clean_environment(SECURE_PROXY_SSL_HEADER="on"),
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "ImproperlyConfigured: SECURE_PROXY_SSL_HEADER='on': expected" in refused.stderr


@pytest.mark.django_db
def test_every_response_carries_the_content_security_policy(client: Client) -> None:
    for path in ("/", "/accounts/login/", "/healthz", "/static/webui/job.js", "/no-such-page/"):
        response = client.get(path)
        assert response["Content-Security-Policy"] == https.CONTENT_SECURITY_POLICY, path
    assert "script-src 'self';" in https.CONTENT_SECURITY_POLICY
    docs = client.get("/api/v1/docs/")  # Swagger UI starts with an inline script
    assert "script-src 'self' 'unsafe-inline';" in docs["Content-Security-Policy"]


# --- the deployment behind nginx -------------------------------------------------------------

SETUP = """
import json
from django.contrib.auth.models import Group, User
from django.utils import timezone
from controlplane.incidents import decisions, tasks
from controlplane.jobs.services import create_job
scenario = json.loads(open({path!r}).read())
ops = User.objects.create_user("ops", password={password!r})
ops.groups.add(Group.objects.get(name="operator"))
live, token = create_job("live", scenario, approval_mode="auto", enabled_policies=["dynamic"])
job, _ = create_job("approve-me", scenario, approval_mode="manual",
                    enabled_policies=["dynamic", "checkpoint"])
_, decision = decisions.record_failure(job, kind="crash", devices=[5], source="agent",
                                       occurred_at=timezone.now(), plan=tasks.enqueue_planning)
print(json.dumps({{"live": live.pk, "agent_token": token, "decision": decision.pk}}))
"""

# The proxy as docs/operations.md ("TLS") describes it. `$host` drops the port, so on this
# port the browser's origin differs from the host the server sees: CSRF_TRUSTED_ORIGINS.
NGINX_CONF = """
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log info;
{user}
events {{ worker_connections 256; }}
http {{
  access_log {tmp}/nginx-access.log;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  fastcgi_temp_path {tmp}/nginx-fastcgi;
  uwsgi_temp_path {tmp}/nginx-uwsgi;
  scgi_temp_path {tmp}/nginx-scgi;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    location / {{
      proxy_pass http://127.0.0.1:{upstream};
      proxy_http_version 1.1;
      proxy_set_header Host $host;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_read_timeout 1h;
    }}
  }}
}}
"""


@dataclass
class Site:
    stack: Stack
    made: dict[str, Any]
    browser: Any
    port: int  # nginx's, https

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    for needed in (NGINX, CHROMIUM):
        if not needed.exists():
            pytest.skip(f"no {needed}: ./dev test installs it (apt-get) when run as root")
    sync_api = pytest.importorskip("playwright.sync_api")
    trustme = pytest.importorskip("trustme")
    tmp = tmp_path_factory.mktemp("tls")
    authority = trustme.CA()
    authority.cert_pem.write_to_path(str(tmp / "ca.pem"))
    issued = authority.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    issued.private_key_pem.write_to_path(str(tmp / "key.pem"))
    fast = json.loads(json.dumps(SCENARIO))
    for layer in ("fwd_s", "bwd_s"):  # steps of a few hundredths of a second
        fast["model"][layer] /= 100
    (tmp / "scenario.json").write_text(json.dumps(fast))
    port = free_port()
    stack = Stack(tmp)
    stack.env.update(TLS_ENVIRONMENT, CSRF_TRUSTED_ORIGINS=f"https://127.0.0.1:{port}")
    stack.manage("migrate", "-v", "0")
    stack.start("redis")  # before the setup, which queues the planning of a failure
    processes: list[subprocess.Popen[bytes]] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            setup = SETUP.format(path=str(tmp / "scenario.json"), password=PASSWORD)
            made = json.loads(stack.manage("shell", "-c", setup))
            for name in ("server", "worker", "detector"):
                stack.start(name)
            processes.append(nginx(tmp, port, stack.port))
            wait_until(lambda: listening(port), timeout_s=30, what="nginx listening")
            processes.append(simulated_agents(stack, tmp, made["agent_token"], port))
            yield Site(stack, made, browser, port)
        finally:
            for process in reversed(processes):
                process.terminate()
                process.wait(timeout=30)
            browser.close()
            stack.stop_all()


def nginx(tmp: Path, port: int, upstream: int) -> subprocess.Popen[bytes]:
    user = f"user {getpass.getuser()};" if os.geteuid() == 0 else ""  # its workers read tmp
    conf = NGINX_CONF.format(
        tmp=tmp, port=port, upstream=upstream, user=user,
        cert=tmp / "cert.pem", key=tmp / "key.pem",
    )  # fmt: skip
    (tmp / "nginx.conf").write_text(conf)
    log = (tmp / "nginx.log").open("wb")
    command = [str(NGINX), "-p", str(tmp), "-e", str(tmp / "nginx-error.log")]
    return subprocess.Popen(
        [*command, "-c", str(tmp / "nginx.conf")], stdout=log, stderr=subprocess.STDOUT
    )


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def simulated_agents(stack: Stack, tmp: Path, token: str, port: int) -> subprocess.Popen[bytes]:
    """Nodes 0 and 1 of the live job, simulated, speaking wss to nginx on ``port``."""
    env = {
        **stack.env,
        "SSL_CERT_FILE": str(tmp / "ca.pem"),  # they trust the test's authority
        "PITSTOP_AGENT_TOKEN": token,
    }
    command = [
        *(sys.executable, "-m", "worker_agent", "simulate"),
        *("--server", f"wss://127.0.0.1:{port}", "--job", "live"),
        *("--nodes", "2", "--devices-per-node", "4", "--scenario", str(tmp / "scenario.json")),
    ]
    log = (tmp / "agents.log").open("wb")
    return subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)


class Browser:
    """The operator's page over https, which fails the test on any console error (a
    content-security-policy violation is one)."""

    def __init__(self, site: Site) -> None:
        self.site = site
        # the test's own authority is not Chromium's: its certificate errors are not ours
        self.context = site.browser.new_context(ignore_https_errors=True)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self.console)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def go(self, path: str) -> Any:
        return self.page.goto(self.site.url + path)

    def log_in(self) -> Any:
        self.go("/accounts/login/")
        self.page.fill("#id_username", "ops")
        self.page.fill("#id_password", PASSWORD)
        with self.page.expect_response(lambda r: r.request.method == "POST") as posted:
            self.page.keyboard.press("Enter")
        if posted.value.status == 302:  # the redirect's page loaded: a goto would cut it off
            self.page.wait_for_url(lambda url: "/accounts/login/" not in url)
        return posted.value

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors


def test_an_operator_logs_in_and_approves_over_https(site: Site) -> None:
    ops = Browser(site)
    login = ops.log_in()
    assert login.status == 302, f"the login POST was answered {login.status}"
    ops.page.wait_for_selector("h1:has-text('Jobs')")
    cookies = {c["name"]: c for c in ops.context.cookies()}
    assert cookies["sessionid"]["secure"] and cookies["csrftoken"]["secure"]
    decision = site.made["decision"]
    deadline = time.monotonic() + 60
    while True:
        page = ops.go(f"/recoveries/{decision}/")
        if ops.page.inner_text("#decision-status") == "proposed":
            break
        assert time.monotonic() < deadline, "the decision was never proposed"
        time.sleep(0.5)
    headers = page.headers
    assert headers["strict-transport-security"] == f"max-age={HSTS_SECONDS}"
    assert headers["content-security-policy"] == https.CONTENT_SECURITY_POLICY
    ops.page.fill("#approve-reason", "approved over https")
    with ops.page.expect_response(lambda r: r.request.method == "POST") as posted:
        ops.page.click("#approve")
    assert posted.value.status == 302, f"the approval POST was answered {posted.value.status}"
    ops.page.wait_for_selector("#decision-status:has-text('applying')")
    assert "Approved by ops: approved over https" in ops.page.inner_text(".why")
    ops.page.wait_for_selector("#gantt .plot-container")  # plotly.js drew under the policy
    ops.close()


def test_agents_and_the_live_dashboard_speak_over_wss(site: Site) -> None:
    ops = Browser(site)
    assert ops.log_in().status == 302
    ops.go(f"/jobs/{site.made['live']}/")
    # both simulated nodes' heartbeats (their sockets: wss through nginx) reach the page (its
    # socket, the page's only source of live numbers: wss through nginx) while it is open
    ops.page.wait_for_function(  # a function: the policy forbids evaluating a string
        "() => document.getElementById('stat-nodes').textContent === '2'"
        " && Number(document.getElementById('stat-step').textContent) > 0",
        timeout=45_000,
    )
    first = int(ops.page.inner_text("#stat-step"))
    ops.page.wait_for_function(
        f"() => Number(document.getElementById('stat-step').textContent) > {first}",
        timeout=10_000,
    )
    assert ops.page.inner_text("#live-state") == "connected"
    ops.close()

"""The dashboard in a real browser (Debian's Chromium driven by Playwright) against a real
control plane in processes (tests/e2e/stack.py) with simulated agents: log in, watch a device
fail, approve, override with an edited plan (a rejected edit first), export a timeline, run a
small simulation, and a viewer who cannot approve. Every page is saved as a screenshot under
var/test-artifacts/screenshots/.

Needs /usr/bin/chromium: `./dev test` installs it (apt-get) when run as root; elsewhere these
tests are skipped, saying so.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import SCENARIO, Stack
from tests.processes import REPO_ROOT

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = REPO_ROOT / "var" / "test-artifacts" / "screenshots"
PASSWORD = "dashboard-pw-1"

SETUP = """
import json
from django.contrib.auth.models import Group, User
from django.utils import timezone
from controlplane.incidents import decisions, tasks
from controlplane.jobs.services import create_job
scenario = json.loads(open({path!r}).read())
made = {{}}
for name, role in (("ops", "operator"), ("viv", "viewer")):
    User.objects.create_user(name, password={password!r}).groups.add(Group.objects.get(name=role))
live, token = create_job("live", scenario, approval_mode="auto", enabled_policies=["dynamic"])
made["live"], made["agent_token"] = live.pk, token
for name, device in (("approve-me", 5), ("override-me", 6)):
    job, _ = create_job(name, scenario, approval_mode="manual",
                        enabled_policies=["dynamic", "checkpoint"])
    process = {{"device": device, "pid": 4000 + device, "exit_code": -6,
               "log": [f"step {{s}} loss 2.3" for s in range(17)]
               + ["Traceback (most recent call last):", '  File "train.py", line 9',
                  "RuntimeError: CUDA error: an illegal memory access was encountered"]}}
    _, decision = decisions.record_failure(job, kind="crash", devices=[device], source="agent",
                                           occurred_at=timezone.now(), process=process,
                                           plan=tasks.enqueue_planning)
    made[name], made.setdefault("jobs", {{}})[name] = decision.pk, job.pk
print(json.dumps(made))
"""


@dataclass
class Site:
    stack: Stack
    made: dict[str, Any]
    browser: Any
    agents: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.stack.port}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM}: ./dev test installs it when run as root")
    sync_api = pytest.importorskip("playwright.sync_api")
    tmp = tmp_path_factory.mktemp("browser")
    fast = json.loads(json.dumps(SCENARIO))
    for layer in ("fwd_s", "bwd_s"):  # steps of a few hundredths of a second
        fast["model"][layer] /= 100
    scenario = tmp / "scenario.json"
    scenario.write_text(json.dumps(fast))
    stack = Stack(tmp)
    stack.manage("migrate", "-v", "0")
    stack.start("redis")  # before the setup, which queues the planning of two failures
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    SCREENSHOTS.mkdir(parents=True)
    agents: dict[int, subprocess.Popen[bytes]] = {}
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            made = json.loads(
                stack.manage("shell", "-c", SETUP.format(path=str(scenario), password=PASSWORD))
            )
            for name in ("server", "worker", "detector"):
                stack.start(name)
            for node in (0, 1):
                agents[node] = agent(stack, made["agent_token"], node, scenario)
            yield Site(stack, made, browser, agents)
        finally:
            for process in agents.values():
                if process.poll() is None:
                    process.kill()
            browser.close()
            stack.stop_all()


def agent(stack: Stack, token: str, node: int, scenario: Path) -> subprocess.Popen[bytes]:
    log = (stack.tmp / f"sim-{node}.log").open("wb")
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "worker_agent", "simulate"),
            *("--server", f"ws://127.0.0.1:{stack.port}", "--job", "live"),
            *("--nodes", "1", "--first-node", str(node)),
            *("--devices-per-node", "4", "--scenario", str(scenario), "--restore-s", "0.1"),
        ],
        env={**stack.env, "PITSTOP_AGENT_TOKEN": token},
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


class Browser:
    """One logged-in user's page, which fails the test on any console error."""

    def __init__(
        self, site: Site, user: str, width: int = 1280, height: int = 800, scheme: str = "light"
    ) -> None:
        self.site = site
        self.context = site.browser.new_context(
            viewport={"width": width, "height": height}, color_scheme=scheme
        )
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self.console)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.go("/")
        self.page.click("text=Log in to the dashboard")
        self.page.fill("#id_username", user)
        self.page.fill("#id_password", PASSWORD)
        self.page.keyboard.press("Enter")  # the keyboard is enough
        self.page.wait_for_selector("h1:has-text('Jobs')")

    def console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def go(self, path: str) -> Any:
        return self.page.goto(self.site.url + path)

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()
        assert not self.errors, self.errors


def wait_proposed(user: Browser, decision: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        user.go(f"/recoveries/{decision}/")
        if user.page.inner_text("#decision-status") == "proposed":
            return
        assert time.monotonic() < deadline, "the decision was never proposed"
        time.sleep(0.5)


def test_an_operator_watches_a_device_fail_within_a_second(site: Site) -> None:
    ops = Browser(site, "ops")
    deadline = time.monotonic() + 45
    while ops.page.locator("tr.attention").count() < 2:  # the manual jobs wait for approval
        assert time.monotonic() < deadline, "no decision was proposed"
        time.sleep(0.5)
        ops.page.reload()
    ops.shot("jobs")
    ops.go(f"/jobs/{site.made['live']}/")
    ops.page.wait_for_function(  # functions, not strings: the pages' policy forbids eval
        "() => document.getElementById('stat-nodes').textContent === '2'"
        " && Number(document.getElementById('stat-step').textContent) > 0",
        timeout=45_000,
    )
    ops.page.wait_for_selector("#chart-loss .plot-container")  # plotly.js came after the page
    ops.page.wait_for_timeout(1500)  # a few points on the charts
    ops.shot("job-live")
    # each node's block is labelled above it: the top strip holds a few pixels of text, where
    # an unlabelled grid starts with a row of solid cells
    strip = ops.page.evaluate(
        "() => { const c = document.getElementById('grid');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, 12).data; let n = 0;"
        " for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return [n, d.length / 4]; }"
    )
    assert 0.01 < strip[0] / strip[1] < 0.3, f"label strip inked {strip}"
    failed = ops.page.locator('[data-count="failed"]')
    assert failed.inner_text() == "0"
    site.agents[1].send_signal(signal.SIGKILL)  # its socket drops: node-1's devices 4-7 fail
    started = time.monotonic()
    ops.page.wait_for_function(
        "() => document.querySelector('[data-count=\"failed\"]').textContent === '4'",
        timeout=5_000,
    )
    took = time.monotonic() - started
    assert took < 1.5, f"the grid showed the failure after {took:.2f} s"
    ops.page.wait_for_timeout(800)
    ops.shot("job-failed")
    ops.page.focus("#grid")
    for _ in range(5):
        ops.page.keyboard.press("ArrowRight")
    said = ops.page.inner_text("#grid-info")
    assert said == "Device 5 on node-1: failed (click, or Enter, for its node)", said
    # the server-drawn parts follow without a reload: the recovery listed, then the new plan
    ops.page.wait_for_selector("#part-recent a[href^='/recoveries/']", timeout=30_000)
    ops.page.wait_for_function(
        "() => document.querySelector('#part-recent .badge').textContent === 'recovered'",
        timeout=45_000,
    )
    cells = ops.page.locator("#part-plan small").all_inner_texts()
    running = {int(d) for c in cells for d in c.removeprefix("dev ").split("·")[0].split(",")}
    assert running and not running & {4, 5, 6, 7}, f"the plan shown still runs on {running}"
    ops.page.locator("#recent-h").scroll_into_view_if_needed()
    ops.shot("job-recovered-live")
    # Enter on the grid's cursor (device 5) opens its node's page, at the device
    ops.page.focus("#grid")
    ops.page.keyboard.press("Enter")
    ops.page.wait_for_url("**/nodes/node-1/#device-5")
    row = ops.page.inner_text("#device-5")
    assert "failed" in row and "node_lost at" in row, row
    assert "failed: node_lost of 4, 5, 6, 7" in ops.page.inner_text("#node-history")
    assert ops.page.inner_text("#last-beat") == "no heartbeat heard now"  # killed
    ops.shot("node")
    ops.close()


def test_the_charts_wait_out_of_sight_and_redraw_every_2_s_in_sight(site: Site) -> None:
    ops = Browser(site, "ops", height=400)
    ops.go(f"/jobs/{site.made['live']}/")
    ops.page.wait_for_selector("#chart-loss .plot-container")
    ops.page.evaluate(
        "() => { window.reacts = 0; const react = Plotly.react;"
        " Plotly.react = (...args) => { window.reacts++; return react(...args); }; }"
    )

    def reacts() -> int:
        return int(ops.page.evaluate("() => window.reacts"))

    def step() -> int:
        return int(ops.page.inner_text("#stat-step"))

    ops.page.evaluate("() => window.scrollTo(0, document.body.scrollHeight)")
    below = ops.page.evaluate(
        "() => document.querySelector('.charts').getBoundingClientRect().bottom"
    )
    assert below < 0, "the charts are still in sight at the page's end"
    ops.page.wait_for_timeout(500)
    before, stepped = reacts(), step()
    ops.page.wait_for_timeout(5000)
    assert step() > stepped, "no live step came while the charts were away"
    assert reacts() == before, "charts out of sight were redrawn"
    ops.page.locator(".charts").scroll_into_view_if_needed()
    ops.page.wait_for_function(f"() => window.reacts > {before}", timeout=3000)  # at once
    shown = reacts()
    ops.page.wait_for_timeout(6000)
    redraws = (reacts() - shown) / 3  # three charts a redraw
    assert 2 <= redraws <= 4, f"{redraws} redraws in 6 s"
    ops.close()


def test_a_nodes_page_shows_the_crashed_process_and_opens_its_last_lines(site: Site) -> None:
    viv = Browser(site, "viv")
    viv.go(f"/jobs/{site.made['jobs']['approve-me']}/nodes/node-1/")
    cell = viv.page.locator("#device-5 td.process")
    assert cell.inner_text().startswith("pid 4005, exited with signal 6 (SIGABRT) (crash at ")
    assert viv.page.locator("#device-5 pre.log").is_hidden()  # folded until asked for
    viv.page.click("#device-5 summary")
    lines = viv.page.inner_text("#device-5 pre.log").splitlines()
    assert len(lines) == 20 and lines[-1].startswith("RuntimeError: CUDA error")
    assert viv.page.inner_text("#device-4 td.process") == "—"
    viv.shot("node-process")
    viv.close()


def test_a_viewer_sees_no_button_and_the_server_refuses_anyway(site: Site) -> None:
    viv = Browser(site, "viv")
    decision = site.made["approve-me"]
    wait_proposed(viv, decision)
    viv.shot("recovery-viewer")
    assert viv.page.locator("#approve").count() == 0
    assert "needs the operator role" in viv.page.inner_text(".act")
    token = next(c["value"] for c in viv.context.cookies() if c["name"] == "csrftoken")
    refused = viv.context.request.post(
        f"{site.url}/recoveries/{decision}/approve/", headers={"X-CSRFToken": token}
    )
    status = refused.status
    assert status == 403
    viv.close()


def test_every_page_counts_the_proposals_waiting_in_its_title(site: Site) -> None:
    """Both manual jobs' proposals wait (the approve and override tests take them later): the
    tab's title says so on any page, and the header offers the browser's notifications."""
    ops = Browser(site, "ops")
    ops.go(f"/jobs/{site.made['live']}/")
    ops.page.wait_for_function("() => document.title.startsWith('(2) ')", timeout=15_000)
    assert ops.page.title() == "(2) live · Pitstop"
    assert ops.page.is_visible("#notify-me")  # the browser has not been asked yet
    ops.close()


def test_an_operator_approves_a_manual_jobs_decision(site: Site) -> None:
    """Two tabs on one proposal: the first approves, the second is told who did, its buttons
    are disabled, and it shows the decision as it is now when asked."""
    ops, other = Browser(site, "ops"), Browser(site, "ops")
    decision = site.made["approve-me"]
    wait_proposed(ops, decision)
    other.go(f"/recoveries/{decision}/")
    ops.shot("recovery-proposed")
    ops.page.fill("#approve-reason", "checked the candidates")
    ops.page.click("#approve")
    ops.page.wait_for_selector("#decision-status:has-text('applying')")
    assert ops.page.locator("#approve").count() == 0
    assert "Approved by ops: checked the candidates" in ops.page.inner_text(".why")
    conflict = other.page.wait_for_selector("#conflict:not([hidden])", timeout=10_000)
    said = conflict.inner_text()
    assert said.startswith("While this page was open, ops approved #"), said
    assert said.endswith("UTC: checked the candidates. The forms below no longer apply."
                         " Show the decision now"), said  # fmt: skip
    assert other.page.is_disabled("#approve") and other.page.is_disabled("#override")
    other.shot("recovery-conflict")
    other.page.click("#show-now")
    other.page.wait_for_function(
        "() => document.getElementById('approve') === null"
        " && ['applying', 'recovered'].includes(document.getElementById('decision-status')"
        ".textContent)",
        timeout=10_000,
    )
    assert "Approved by ops: checked the candidates" in other.page.inner_text(".why")
    other.close()
    ops.close()


def test_an_operator_overrides_with_an_edited_plan_after_a_rejected_one(site: Site) -> None:
    ops = Browser(site, "ops")
    decision = site.made["override-me"]
    wait_proposed(ops, decision)
    proposal = json.loads(ops.page.input_value("#override-plan"))
    bad = json.loads(json.dumps(proposal))
    bad["pipelines"][0]["stages"][0]["devices"] = [6]  # the failed device
    ops.page.check("#use-plan")
    ops.page.fill("#override-plan", json.dumps(bad, indent=1))
    ops.page.click("#override")
    error = ops.page.wait_for_selector("#plan-error")
    assert "plan.pipelines[0].stages[0]" in error.inner_text()
    assert ops.page.get_attribute("#override-plan", "aria-invalid") == "true"
    ops.page.locator("#plan-error").scroll_into_view_if_needed()
    ops.shot("recovery-override-error")
    ops.page.check("#use-plan")
    ops.page.fill("#override-plan", json.dumps(proposal, indent=1))
    ops.page.fill("#override-reason", "the proposal, by hand")
    ops.page.click("#override")
    ops.page.wait_for_selector("#decision-status:has-text('applying')")
    assert "ops overrode the proposal with an edited plan" in ops.page.inner_text(".why")
    ops.shot("recovery-overridden")
    ops.close()


def test_a_recovery_timeline_is_drawn_and_exported(site: Site) -> None:
    ops = Browser(site, "ops")
    ops.go(f"/jobs/{site.made['live']}/")
    link = ops.page.wait_for_selector("#banner a, td a[href^='/recoveries/']", timeout=30_000)
    ops.go(link.get_attribute("href"))
    ops.page.wait_for_function(  # no reload: the page draws itself again as the decision moves
        "() => document.getElementById('decision-status').textContent === 'recovered'"
        " && document.querySelectorAll('table.phases td:last-child').length === 6"
        " && [...document.querySelectorAll('table.phases td:last-child')]"
        ".every((cell) => cell.textContent !== '—')",
        timeout=45_000,
    )
    ops.page.wait_for_selector("#gantt .plot-container")
    # the detector measures the step time once the recovery settled; the page follows
    ops.page.wait_for_function(
        "() => document.querySelectorAll('#estimates td').length === 6"
        " && !document.getElementById('estimates').textContent.includes('not yet')",
        timeout=30_000,
    )
    ops.page.wait_for_selector("#gantt .plot-container")
    ops.shot("recovery-timeline")
    exported = ops.context.request.get(site.url + ops.page.get_attribute("#export-json", "href"))
    kinds = [e["kind"] for e in exported.json()["results"]]
    assert kinds[0] == "failure_detected" and "recovered" in kinds
    csv = ops.context.request.get(site.url + ops.page.get_attribute("#export-csv", "href"))
    assert csv.text().startswith("id,at,kind,actor,decision,failure,step,payload")
    table = ops.context.request.get(site.url + ops.page.get_attribute("#export-phases", "href"))
    assert table.text().splitlines()[0] == "phase,start,end,seconds"
    assert len(table.text().splitlines()) == 7
    assert table.headers["content-disposition"].endswith('-phases.csv"')
    ops.close()


def test_what_if_and_a_small_simulation_run_to_completion(site: Site) -> None:
    ops = Browser(site, "ops")
    ops.go(f"/jobs/{site.made['jobs']['override-me']}/what-if/")
    ops.page.fill("#devices", "1")
    ops.page.click("text=Compare the policies")
    ops.page.wait_for_selector("table.candidates")
    ops.shot("what-if")
    ops.go("/simulations/")
    ops.page.select_option("#job", label="live")
    for box in ops.page.locator("input[name=policies]").all():
        box.set_checked(box.get_attribute("value") in ("dynamic", "checkpoint", "pitstop"))
    ops.page.fill("#hours", "2")
    ops.page.fill("#seeds", "2")
    ops.page.fill("#name", "browser")
    ops.page.click("text=Start the simulation")
    ops.page.wait_for_selector("#sweep-status:has-text('done')", timeout=60_000)
    ops.page.wait_for_selector("#chart-downtime .plot-container")
    assert ops.page.locator("#summary-table tbody tr").count() == 3
    said = ops.page.inner_text("#choice-gain")  # pitstop against the better of the other two
    assert re.fullmatch(
        r"pitstop trained \d\.\d{3}× the samples of the best fixed policy here, "
        r"(dynamic|checkpoint) \(95 % interval \d\.\d{3}×–\d\.\d{3}× over 2 seeds\): .+\.",
        said,
    ), said
    ops.shot("simulation")
    ops.go("/simulations/")
    ops.shot("simulations")
    ops.close()
    narrow = Browser(site, "ops", width=390, height=844)
    fits = "document.documentElement.scrollWidth <= window.innerWidth"
    narrow.shot("jobs-narrow")
    assert narrow.page.evaluate(fits)
    for name, path in (("job", f"/jobs/{site.made['live']}/"),
                       ("recovery", f"/recoveries/{site.made['override-me']}/")):  # fmt: skip
        narrow.go(path)
        narrow.page.wait_for_timeout(500)
        narrow.shot(f"{name}-narrow")
        assert narrow.page.evaluate(fits), f"the {name} page is wider than a phone"
    narrow.close()


def test_an_operator_injects_a_drill_from_the_job_page(site: Site) -> None:
    # last: the drill's failure is a second one of the live job (after node-1's agent's kill)
    ops = Browser(site, "ops")
    ops.go(f"/jobs/{site.made['live']}/")
    failed_before = int(ops.page.inner_text('[data-count="failed"]'))
    ops.page.fill("#drill-node", "node-9")  # no such node: refused beside the field
    ops.page.select_option("#drill-kind", "kill")
    ops.page.fill("#drill-device", "2")
    ops.page.click("#drill")
    error = ops.page.wait_for_selector("#drill-error")
    assert "job live has no node 'node-9'" in error.inner_text()
    assert ops.page.locator("#drills tbody tr").count() == 0, "nothing was sent"
    assert ops.page.get_attribute("#drill-node", "aria-invalid") == "true"
    ops.page.fill("#drill-node", "node-0")
    ops.page.fill("#drill-device", "2")
    ops.page.click("#drill")
    ops.page.wait_for_selector("#drills tbody tr")
    first = ops.page.locator("#drills tbody tr").first
    assert "kill" in first.inner_text() and "node-0 device 2" in first.inner_text()
    ops.page.wait_for_function(  # no reload: the page draws its drills again when acked
        "() => document.querySelector('#drills tbody tr td:last-child').textContent === 'done'",
        timeout=30_000,
    )
    ops.page.wait_for_function(
        "() => Number(document.querySelector('[data-count=\"failed\"]').textContent)"
        f" > {failed_before}",
        timeout=10_000,
    )
    ops.page.locator("#drills-h").scroll_into_view_if_needed()
    ops.shot("job-drill")
    ops.close()


def test_the_dark_theme_follows_the_system_and_keeps_the_pages_readable(site: Site) -> None:
    viv = Browser(site, "viv", scheme="dark")
    # the detector keeps the job's history, a point every 2 s: let it gather a few
    metrics = f"{site.url}/api/v1/jobs/{site.made['live']}/metrics/"
    deadline = time.monotonic() + 45
    while len(viv.context.request.get(metrics).json()) < 8:
        assert time.monotonic() < deadline, "the detector kept no history"
        time.sleep(0.5)
    viv.go(f"/jobs/{site.made['live']}/")
    viv.page.wait_for_selector("#chart-loss .plot-container")
    # the charts start from that history, not from the page's load
    kept = viv.page.inner_text("#range-note")
    assert int(kept.split()[0]) >= 8, kept
    drawn = "() => document.getElementById('chart-loss').data[0].x.length"
    assert viv.page.evaluate(drawn) >= int(kept.split()[0])
    viv.page.wait_for_timeout(1500)  # a few live points after it
    with viv.page.expect_response(lambda r: r.url.endswith("/metrics/")) as whole:
        viv.page.select_option("#range", "0")  # the whole run: no `since`
    assert whole.value.ok and len(whole.value.json()) >= int(kept.split()[0])
    viv.shot("job-dark")
    background = viv.page.evaluate("() => getComputedStyle(document.body).backgroundColor")
    ink = viv.page.evaluate("() => getComputedStyle(document.body).color")
    assert background == "rgb(20, 23, 29)" and ink == "rgb(228, 232, 239)"
    viv.go(f"/recoveries/{site.made['override-me']}/")
    viv.shot("recovery-dark")
    viv.close()


def test_a_viewer_digs_through_the_incidents_and_the_jobs_archive(site: Site) -> None:
    viv = Browser(site, "viv")
    viv.page.click("nav >> text=Incidents")
    viv.page.wait_for_selector("#incidents tbody tr")
    every = viv.page.locator("#incidents tbody tr").count()
    assert every >= 2  # the two manual jobs' failures at least
    viv.page.select_option("#f-job", label="approve-me")
    viv.page.click("#incident-filters button")
    viv.page.wait_for_url("**/incidents/?*job=*")
    rows = viv.page.locator("#incidents tbody tr")
    assert rows.count() == 1 and "approve-me" in rows.first.inner_text()
    viv.shot("incidents")
    viv.page.click("nav >> text=Jobs")
    viv.page.fill("#f-name", "me")  # approve-me, override-me
    viv.page.select_option("#f-sort", "name")
    viv.page.click("#job-filters button")
    viv.page.wait_for_url("**/jobs/?*name=me*")
    listed = viv.page.locator("table.jobs tbody th a").all_inner_texts()
    assert listed == ["approve-me", "override-me"], listed
    viv.page.click("#archive")
    viv.page.wait_for_selector("text=No job matches.")  # no job of this stack finished
    viv.shot("jobs-archive")
    narrow = Browser(site, "viv", width=390, height=844)
    for path in ("/incidents/", "/jobs/?show=all"):
        narrow.go(path)
        fits = "document.documentElement.scrollWidth <= window.innerWidth"
        assert narrow.page.evaluate(fits), f"{path} is wider than a phone"
    narrow.close()
    viv.close()


def test_a_logout_in_another_tab_stops_the_live_page_and_says_so(site: Site) -> None:
    ops = Browser(site, "ops")
    ops.go(f"/jobs/{site.made['live']}/")
    ops.page.wait_for_selector("#live-state:has-text('connected')")
    assert ops.page.is_hidden("#session-ended")
    tab = ops.context.new_page()  # the same browser, so the same session
    tab.goto(f"{site.url}/jobs/")
    tab.click("text=Log out")
    tab.wait_for_selector("#id_username")
    started = time.monotonic()
    ops.page.wait_for_selector("#session-ended", state="visible", timeout=10_000)
    took = time.monotonic() - started
    assert ops.page.inner_text("#live-state") == "stopped: session ended"
    assert ops.page.locator("#main section.stale").count() >= 4
    assert ops.page.title().startswith("(session ended) ")
    ops.shot("job-session-ended")
    assert took < 5, f"the page noticed the logout after {took:.1f} s"
    # the page's scripts were told 401 on purpose; Chromium logs each as a console error
    ops.errors = [e for e in ops.errors if "401 (Unauthorized)" not in e]
    ops.close()

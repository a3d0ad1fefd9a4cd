"""The dashboard's cost to the browser: one open job tab's main-thread busy time a minute, and
a cold first load of the job page, in Debian's Chromium (Playwright), against the demo's stack.

    python -m benchmarks.dashboard_load [--seconds 60] [--loads 5] [--nodes 4]

It starts the control plane (server, Celery worker, detector; the embedded defaults in a
temporary data directory), a job of ``--nodes`` simulated nodes of 8 devices (live heartbeats,
loss and step time: what the job page charts), logs in as an admin and measures:

- **busy**: Chrome's own count of the main thread's task time (the DevTools protocol's
  ``Performance.getMetrics`` ``TaskDuration``) while the job page stays open and visible for
  ``--seconds``, as seconds a minute; beside it, in the same run, the jobs list open as long
  (the baseline: a page that only asks for the proposals waiting), and the ratio;
- **cold load**: ``--loads`` first loads of the job page, each in a new browser context (no
  cache): navigation start to the load event, to the first live message drawn (the step
  shown), and to the charts drawn (plotly.js is fetched after the load event); beside them the
  login page's cold load (the baseline), and the ratio.

The busy time is counted from two seconds after the charts were drawn and scrolled into sight
(the page does not redraw charts out of sight): an open tab's steady cost, not its first
load's.

Prints a table and writes JSON (``benchmarks/results/dashboard_load.json``, ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.launch_restart import stack_environment
from benchmarks.results import write_results
from controlplane.demo import LARGE, ControlPlane, Processes, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
USER, PASSWORD = "bench", "dashboard-bench-1"


def log_in(page: Any, url: str) -> None:
    """The benchmark's user logged in on ``page``, landed on the jobs list."""
    page.goto(f"{url}/accounts/login/")
    page.fill("#id_username", USER)
    page.fill("#id_password", PASSWORD)
    page.keyboard.press("Enter")
    page.wait_for_selector("h1:has-text('Jobs')")


def busy_s_a_minute(page: Any, seconds: float) -> float:
    """The page's main-thread task seconds over ``seconds`` (DevTools' TaskDuration), a minute."""
    session = page.context.new_cdp_session(page)
    session.send("Performance.enable")

    def task_s() -> float:
        metrics = session.send("Performance.getMetrics")["metrics"]
        return float(next(m["value"] for m in metrics if m["name"] == "TaskDuration"))

    before = task_s()
    page.wait_for_timeout(seconds * 1000)
    return (task_s() - before) / seconds * 60


def cold_load(browser: Any, url: str, path: str, ready: dict[str, str]) -> dict[str, float]:
    """A new context (empty cache) logged in, then ``path`` loaded: to its load event, and to
    each of ``ready`` (name: a function of the page), waited for in turn."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    if path != "/accounts/login/":
        log_in(page, url)
        # the login fetched the stylesheet: a new context with the session's cookie alone
        cookies = context.cookies()
        context.close()
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.add_cookies(cookies)
        page = context.new_page()
    started = time.perf_counter()
    page.goto(f"{url}{path}")
    loaded = page.evaluate(
        "() => { const n = performance.getEntriesByType('navigation')[0];"
        " return n.loadEventEnd - n.startTime; }"
    )
    out = {"load_s": loaded / 1000}
    for name, condition in ready.items():
        page.wait_for_function(condition, timeout=60_000)
        out[name] = time.perf_counter() - started
    context.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long each tab stays open")
    p.add_argument("--loads", type=int, default=5, help="cold loads of each page")
    p.add_argument("--nodes", type=int, default=4, help="simulated nodes of 8 devices")
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/dashboard_load.json",
        help="the JSON results' path",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.loads < 1 or args.nodes < 1:
        p.error("--seconds > 0, --loads ≥ 1, --nodes ≥ 1")
    if not CHROMIUM.exists():
        p.error(f"no Chromium at {CHROMIUM} (./dev test installs it when run as root)")
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="pitstop-dashboard-") as tmp:
        data = Path(tmp)
        # the demo's environment, on its own data (embedded defaults, whatever the URLs say)
        env = stack_environment(data)  # heartbeats twice a second, as the demo's
        (data / "logs").mkdir()
        processes = Processes(data / "logs", env)
        plane = ControlPlane(data, free_port(), processes)
        try:
            plane.start()
            scenario = json.loads(LARGE.read_text())
            made = plane.setup(USER, PASSWORD, [
                {"name": "bench", "scenario": scenario, "mode": "auto", "policies": ["dynamic"]}
            ])  # fmt: skip
            job = made["jobs"]["bench"]
            processes.start(
                "simulated",
                [sys.executable, "-m", "worker_agent", "simulate",
                 "--server", f"ws://127.0.0.1:{plane.port}", "--job", "bench",
                 "--nodes", str(args.nodes), "--devices-per-node", "8",
                 "--scenario", str(LARGE)],
                {"PITSTOP_AGENT_TOKEN": job["token"]},
            )  # fmt: skip
            wait_for(
                lambda: (plane.api(f"/api/v1/jobs/{job['id']}/live/").get("step") or 0) > 0,
                "the simulated job's first step",
                120,
                processes,
            )
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
                try:
                    results = measure(browser, plane.url, job["id"], args)
                finally:
                    browser.close()
        finally:
            processes.stop_all(last=["server"])
    report(results)
    write_results(args.out, {"benchmark": "dashboard_load", "results": results})
    return 0


def measure(browser: Any, url: str, job: int, args: argparse.Namespace) -> dict[str, Any]:
    step_shown = "() => Number(document.getElementById('stat-step').textContent) > 0"
    charts_drawn = "() => document.querySelector('#chart-loss .plot-container') !== null"
    ready = {"live_s": step_shown, "charts_s": charts_drawn}
    job_page = f"/jobs/{job}/"
    loads = [cold_load(browser, url, job_page, ready) for _ in range(args.loads)]
    logins = [cold_load(browser, url, "/accounts/login/", {}) for _ in range(args.loads)]
    busy = {}
    for name, path in (("job page", job_page), ("jobs list (baseline)", "/jobs/")):
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        page = context.new_page()
        log_in(page, url)
        page.goto(f"{url}{path}")
        if path == job_page:
            page.wait_for_function(step_shown, timeout=60_000)
            page.wait_for_function(charts_drawn, timeout=60_000)
            # the charts in sight: the page does not redraw them while they are scrolled away
            page.locator(".charts").scroll_into_view_if_needed()
        page.wait_for_timeout(2000)  # settled: the first load's work is not counted
        busy[name] = busy_s_a_minute(page, args.seconds)
        context.close()
    median = statistics.median
    return {
        "seconds": args.seconds,
        "nodes": args.nodes,
        "busy_s_a_minute": busy,
        "busy_ratio": busy["job page"] / max(busy["jobs list (baseline)"], 1e-9),
        "job_page_load_s": [x["load_s"] for x in loads],
        "job_page_live_s": [x["live_s"] for x in loads],
        "job_page_charts_s": [x["charts_s"] for x in loads],
        "login_load_s": [x["load_s"] for x in logins],
        "load_ratio": median([x["load_s"] for x in loads])
        / max(median([x["load_s"] for x in logins]), 1e-9),
    }


def report(results: dict[str, Any]) -> None:
    median = statistics.median
    print(f"one tab open {results['seconds']:.0f} s, {results['nodes']} simulated nodes of 8")
    print(f"{'page':<24}{'busy s/min':>12}")
    for name, value in results["busy_s_a_minute"].items():
        print(f"{name:<24}{value:>12.2f}")
    print(f"ratio job page / baseline: {results['busy_ratio']:.1f}×")
    print(f"{'cold load':<24}{'median s':>10}{'max s':>8}")
    for name, key in (("job page: load event", "job_page_load_s"),
                      ("job page: first live", "job_page_live_s"),
                      ("job page: charts drawn", "job_page_charts_s"),
                      ("login page (baseline)", "login_load_s")):  # fmt: skip
        values = results[key]
        print(f"{name:<24}{median(values):>10.2f}{max(values):>8.2f}")
    print(f"ratio job page / login page: {results['load_ratio']:.1f}×")


if __name__ == "__main__":
    raise SystemExit(main())

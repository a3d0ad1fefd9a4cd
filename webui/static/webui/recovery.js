// A recovery, live: its phases as a Gantt chart (one bar a phase, from its start for its
// seconds), the override editor's plan fetched on demand when it is too large to come with the
// page, and the decision watched every few seconds (/recoveries/<id>/state/). When it changes
// the page is drawn again in place, unless the user has typed into a form: then, or when
// someone else decided while the forms were open, the page says what happened and waits.
"use strict";
(function () {
  const WATCH_MS = 2000;
  const OPEN = ["planning", "proposed"];
  const watch = document.getElementById("watch");
  let status = watch.dataset.status, events = Number(watch.dataset.events);
  let measured = watch.dataset.measured === "true";
  let asking = false, waiting = false, over = false;

  function wire() {
    const load = document.getElementById("load-plan");
    if (load) {
      load.addEventListener("click", async () => {
        load.disabled = true;
        const answer = await fetch(load.dataset.url, { credentials: "same-origin" });
        if (!answer.ok) { load.textContent = `Could not load the plan (${answer.status})`; return; }
        document.getElementById("override-plan").value = JSON.stringify(await answer.json(), null, 1);
        document.getElementById("use-plan").checked = true;
        load.remove();
      });
    }
    document.getElementById("show-now").addEventListener("click", redraw);
    window.pitstopCharts.whenPlotly(gantt);
  }

  function gantt() {
    const phases = JSON.parse(document.getElementById("phases").textContent).filter((p) => p.start && p.end);
    const target = document.getElementById("gantt");
    if (!phases.length) { target.textContent = "No phase has ended yet."; return; }
    const colours = ["#e15759", "#f28e2b", "#edc948", "#4e79a7", "#b07aa1", "#59a14f"];
    Plotly.newPlot(target, [{
      type: "bar", orientation: "h",
      y: phases.map((p) => p.phase),
      base: phases.map((p) => p.start),
      x: phases.map((p) => Math.max(new Date(p.end) - new Date(p.start), 1)),
      marker: { color: phases.map((_, i) => colours[i % colours.length]) },
      text: phases.map((p) => `${p.seconds.toFixed(3)} s`), textposition: "auto",
      hovertemplate: "%{y}: %{text}<extra></extra>",
    }], {
      margin: { l: 80, r: 16, t: 10, b: 40 }, height: 300,
      xaxis: { type: "date", title: { text: "time" } },
      yaxis: { autorange: "reversed" },
    }, { displayModeBar: false, responsive: true });
  }

  // Whether the user has put something into a form that drawing the page again would lose.
  function typed() {
    return [...document.querySelectorAll(".act input:not([type=radio]):not([type=hidden]), .act textarea")]
      .some((field) => field.value !== field.defaultValue);
  }

  async function redraw() {
    const answer = await fetch(location.pathname, { credentials: "same-origin" });
    if (!answer.ok) return;
    const fresh = new DOMParser().parseFromString(await answer.text(), "text/html");
    document.getElementById("main").innerHTML = fresh.getElementById("main").innerHTML;
    const now = document.getElementById("watch");
    status = now.dataset.status;
    events = Number(now.dataset.events);
    measured = now.dataset.measured === "true";
    waiting = false;
    wire();
  }

  // Someone else decided while the forms were open (final), or the decision moved on while the
  // user typed: say so, keep what was typed, and draw the page again only when asked.
  function conflict(said, now, final) {
    const badge = document.getElementById("decision-status");
    badge.textContent = now;
    badge.className = `badge ${now}`;
    const box = document.getElementById("conflict");
    box.querySelector("span").textContent = `While this page was open, ${said}.`
      + (final ? " The forms below no longer apply." : "");
    box.hidden = false;
    if (final) for (const button of document.querySelectorAll(".act button")) button.disabled = true;
    waiting = true;
  }

  async function look() {
    if (asking || waiting || over || document.hidden) return;
    asking = true;
    try {
      const answer = await fetch(watch.dataset.state, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (answer.status === 401) {
        over = true;
        document.dispatchEvent(new CustomEvent("pitstop:session-ended"));
        return;
      }
      if (!answer.ok) return;
      const now = await answer.json();
      if (now.status === status && now.events === events && now.measured === measured) return;
      const forms = document.querySelector(".act form") !== null;
      if (forms && OPEN.includes(status) && !OPEN.includes(now.status)) conflict(now.decided || `it became ${now.status}`, now.status, true);
      else if (typed()) conflict(now.status === status ? "its timeline moved on" : `it became ${now.status}`, now.status, false);
      else await redraw();
    } catch (error) {
      // the network: the next look tries again
    } finally {
      asking = false;
    }
  }

  wire();
  setInterval(look, WATCH_MS);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) look(); });
})();

// A recovery's phases as a Gantt chart (one bar a phase, from its start for its seconds), and
// the override editor's plan, fetched on demand when it is too large to come with the page.
"use strict";
(function () {
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
})();
(function () {
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
})();

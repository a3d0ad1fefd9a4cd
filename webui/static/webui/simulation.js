// A simulation sweep: its progress from the REST API until it is done, then the summary's plots.
"use strict";
(function () {
  const config = JSON.parse(document.getElementById("sweep-config").textContent);
  const layout = (title, x, y) => ({
    title: { text: title, font: { size: 14 } }, height: 300, margin: { l: 60, r: 12, t: 36, b: 44 },
    xaxis: { title: { text: x } }, yaxis: { title: { text: y } }, legend: { orientation: "h", y: -0.25 },
  });
  const options = { displayModeBar: false, responsive: true };

  // pitstop against the best fixed policy of this sweep, in words: does choosing pay here?
  function choiceGain(gain) {
    const box = document.getElementById("choice-gain");
    if (!gain) return;
    const times = (x) => `${x.toFixed(3)}×`;
    const verdict = gain.pays
      ? "choosing per failure pays here (5 % or more)"
      : gain.mean >= 1 ? "under 5 %: here it about matches the best fixed policy" : "the best fixed policy does better here";
    box.textContent = `${gain.policy} trained ${times(gain.mean)} the samples of the best fixed policy here, ` +
      `${gain.against} (95 % interval ${times(gain.ci95[0])}–${times(gain.ci95[1])} over ${gain.seeds} seed${gain.seeds === 1 ? "" : "s"}): ${verdict}.`;
    box.classList.remove("hidden");
  }

  function show(summary) {
    document.getElementById("results").classList.remove("hidden");
    choiceGain(summary.choice_gain);
    const curves = summary.curves;
    const names = Object.keys(curves.samples);
    Plotly.newPlot("chart-samples", names.map((n) => ({ x: curves.hours, y: curves.samples[n], name: n, mode: "lines" })),
      layout("Samples trained", "hours", "samples"), options);
    Plotly.newPlot("chart-throughput", names.map((n) => ({ x: curves.hours.slice(1), y: curves.throughput[n], name: n, mode: "lines" })),
      layout("Throughput", "hours", "samples/s"), options);
    const policies = Object.keys(summary.share_of_ideal);
    Plotly.newPlot("chart-share", [{
      type: "bar", x: policies, y: policies.map((p) => summary.share_of_ideal[p].mean),
      error_y: { type: "data", symmetric: false,
        array: policies.map((p) => summary.share_of_ideal[p].ci95[1] - summary.share_of_ideal[p].mean),
        arrayminus: policies.map((p) => summary.share_of_ideal[p].mean - summary.share_of_ideal[p].ci95[0]) },
    }], layout("Share of the ideal (95 % interval)", "", "share"), options);
    const causes = Object.keys(summary.policies[policies[0]].downtime_by_cause_s_mean);
    Plotly.newPlot("chart-downtime", causes.map((c) => ({
      type: "bar", name: c, x: policies, y: policies.map((p) => summary.policies[p].downtime_by_cause_s_mean[c]),
      marker: { color: config.colours[c] },
    })), { ...layout("Downtime by cause (mean)", "", "seconds"), barmode: "stack", height: 340 }, options);
    const body = document.querySelector("#summary-table tbody");
    body.innerHTML = "";
    for (const p of policies) {
      const row = body.insertRow(), s = summary.policies[p];
      for (const value of [p, Math.round(s.samples_mean), summary.share_of_ideal[p].mean.toFixed(3), s.downtime_s_mean.toFixed(1), s.recoveries_mean.toFixed(1)]) {
        row.insertCell().textContent = value;
      }
    }
  }

  async function poll() {
    const response = await fetch(config.api, { headers: { Accept: "application/json" } });
    const sweep = await response.json();
    document.getElementById("progress").value = sweep.pieces_done;
    document.getElementById("progress-text").textContent = `${sweep.pieces_done} of ${sweep.pieces_total} pieces`;
    const status = document.getElementById("sweep-status");
    status.textContent = sweep.status;
    status.className = `badge ${sweep.status}`;
    if (sweep.status === "done") return show(sweep.summary);
    if (sweep.status === "failed") {
      const error = document.getElementById("sweep-error");
      error.textContent = sweep.error;
      error.classList.remove("hidden");
      return;
    }
    setTimeout(poll, 1000);
  }

  if (config.status === "done") show(config.summary);
  else if (config.status !== "failed") poll();
})();

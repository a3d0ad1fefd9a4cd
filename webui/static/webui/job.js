// A job, live: the device grid on a canvas, charts of loss, throughput and step time, and a
// banner for the open decision, all from /ws/dashboard/jobs/<id>/ (controlplane/streaming/dashboard.py).
// The server-drawn parts (the plan running, the recoveries, the drills) are fetched again from
// /jobs/<id>/parts/ whenever the socket says the job's decisions, drills or devices changed;
// while the socket is down every live part is marked stale; a session that ended stops it.
"use strict";
(function () {
  const config = JSON.parse(document.getElementById("job-config").textContent);
  const COLOURS = { h: "#59a14f", s: "#edc948", f: "#e15759", p: "#9aa5b8", r: "#4e79a7", u: "#ffffff" };
  const NAMES = { h: "healthy", s: "suspect", f: "failed", p: "spare", r: "recovering", u: "unheard" };
  const LABELS = { ...NAMES, u: "not yet heard (its node has not said hello)" };
  const MOST_POINTS = 5000; // per chart: the server's history (2,000 at most) and what came live
  const canvas = document.getElementById("grid");
  const info = document.getElementById("grid-info");
  let stored = config.states; // the database's states, one letter a device
  let beats = ""; // the heartbeats' states, "." where none
  let cursor = 0;
  let layout = null;

  // Whether device i's node was still expected (no hello) when the page was drawn.
  function expected(i) {
    const node = config.nodes.find((n) => i >= n[1] && i < n[1] + n[2]);
    return Boolean(node && node[3] === "expected");
  }

  // The state shown: a failure or a spare is the database's word; a heartbeat tells the rest;
  // a device of a node expected and never heard is "not yet heard", never healthy.
  function stateOf(i) {
    const db = stored[i], beat = beats[i] || ".";
    if (db === "f" || beat === "f") return "f";
    if (beat === "r") return "r";
    if (beat === "." && (db === "u" || expected(i))) return "u";
    if (db === "u") return beat === "s" ? "s" : "h";
    if (db === "p" || beat === ".") return db;
    return beat === "s" ? "s" : db;
  }

  // Nodes are blocks of cells side by side, wrapped into rows that fit the page's width; each
  // block is labelled with its node's name above it where the cells are large enough to read.
  const LABEL = 14; // px of a row given to the names
  function computeLayout() {
    const perNode = Math.max(1, ...config.nodes.map((n) => n[2]));
    const width = canvas.parentElement.clientWidth - 2;
    const devices = stored.length;
    const cell = Math.max(4, Math.min(28, Math.floor(Math.sqrt((width * 520) / Math.max(devices, 1)))));
    const nodeWidth = perNode * cell + 3;
    const perRow = Math.max(1, Math.floor(width / nodeWidth));
    const rows = Math.ceil(config.nodes.length / perRow);
    const label = cell >= 10 && nodeWidth >= 36 ? LABEL : 0;
    const rowHeight = label + cell + 3;
    layout = { cell, perNode, nodeWidth, perRow, label, rowHeight };
    canvas.width = Math.min(width, perRow * nodeWidth);
    canvas.height = rows * rowHeight;
  }

  function where(device) {
    const node = config.nodes.findIndex((n) => device >= n[1] && device < n[1] + n[2]);
    const slot = device - config.nodes[node][1];
    return {
      node,
      x: (node % layout.perRow) * layout.nodeWidth + slot * layout.cell,
      y: Math.floor(node / layout.perRow) * layout.rowHeight + layout.label,
    };
  }

  const labelInk = getComputedStyle(document.body).color;
  function draw() {
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const { cell, perRow, nodeWidth, label, rowHeight } = layout;
    const gap = cell > 6 ? 1 : 0;
    const counts = { h: 0, s: 0, f: 0, p: 0, r: 0, u: 0 };
    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "top";
    config.nodes.forEach(([name, first, count], node) => {
      const x0 = (node % perRow) * nodeWidth, top = Math.floor(node / perRow) * rowHeight;
      const y0 = top + label;
      if (label) {
        ctx.fillStyle = labelInk;
        ctx.fillText(name, x0, top + 1, nodeWidth - 5);
      }
      for (let k = 0; k < count; k++) {
        const state = stateOf(first + k);
        counts[state] += 1;
        ctx.fillStyle = COLOURS[state];
        ctx.fillRect(x0 + k * cell, y0, cell - gap, cell - gap);
        if (state === "u") { // hollow: nothing heard from it
          ctx.strokeStyle = "#6b7485";
          ctx.lineWidth = 1;
          ctx.strokeRect(x0 + k * cell + 0.5, y0 + 0.5, cell - gap - 1, cell - gap - 1);
        }
        mark(ctx, state, x0 + k * cell, y0, cell - gap);
      }
    });
    if (document.activeElement === canvas && stored.length) {
      const at = where(cursor);
      ctx.strokeStyle = "#1d2330";
      ctx.lineWidth = 2;
      ctx.strokeRect(at.x + 1, at.y + 1, cell - 2, cell - 2);
    }
    for (const letter in counts) {
      const shown = document.querySelector(`[data-count="${NAMES[letter]}"]`);
      if (shown) shown.textContent = counts[letter];
    }
  }

  // A shape on top of the colour, so that no state is told by red against green alone:
  // failed ✕, suspect a slash, recovering a dot (cells too small for one keep the colour).
  function mark(ctx, state, x, y, size) {
    if (size < 8 || !"fsr".includes(state)) return;
    const m = Math.max(2, Math.round(size / 4));
    ctx.strokeStyle = "#ffffff";
    ctx.fillStyle = "#ffffff";
    ctx.lineWidth = Math.max(1.5, size / 10);
    ctx.beginPath();
    if (state === "f") {
      ctx.moveTo(x + m, y + m); ctx.lineTo(x + size - m, y + size - m);
      ctx.moveTo(x + size - m, y + m); ctx.lineTo(x + m, y + size - m);
      ctx.stroke();
    } else if (state === "s") {
      ctx.strokeStyle = "#1d2330";
      ctx.moveTo(x + m, y + size - m); ctx.lineTo(x + size - m, y + m);
      ctx.stroke();
    } else {
      ctx.arc(x + size / 2, y + size / 2, Math.max(1.5, size / 6), 0, 2 * Math.PI);
      ctx.fill();
    }
  }

  function describe(device) {
    const node = config.nodes.find((n) => device >= n[1] && device < n[1] + n[2]);
    info.textContent = `Device ${device} on ${node ? node[0] : "?"}: ${LABELS[stateOf(device)]} (click, or Enter, for its node)`;
  }

  // the device under the pointer, or null; a click (or Enter on the cursor) opens its node's page
  function pointed(event) {
    const box = canvas.getBoundingClientRect();
    const x = event.clientX - box.left, y = event.clientY - box.top;
    const node = Math.floor(y / layout.rowHeight) * layout.perRow + Math.floor(x / layout.nodeWidth);
    if (node >= config.nodes.length) return null;
    if (y % layout.rowHeight < layout.label) return config.nodes[node][1]; // its name: its first device
    const slot = Math.floor((x % layout.nodeWidth) / layout.cell);
    return slot < config.nodes[node][2] ? config.nodes[node][1] + slot : null;
  }
  function open(device) {
    const node = config.nodes.find((n) => device >= n[1] && device < n[1] + n[2]);
    if (node) location.assign(`${config.node_url.replace("__node__", encodeURIComponent(node[0]))}#device-${device}`);
  }
  canvas.addEventListener("mousemove", (event) => {
    const device = pointed(event);
    if (device !== null) describe(device);
  });
  canvas.addEventListener("click", (event) => {
    const device = pointed(event);
    if (device !== null) open(device);
  });
  canvas.addEventListener("keydown", (event) => {
    if (event.key === "Enter") { open(cursor); return; }
    const steps = { ArrowRight: 1, ArrowLeft: -1, ArrowDown: layout.perNode * layout.perRow, ArrowUp: -layout.perNode * layout.perRow };
    if (!(event.key in steps)) return;
    event.preventDefault();
    cursor = Math.min(stored.length - 1, Math.max(0, cursor + steps[event.key]));
    describe(cursor);
    draw();
  });
  canvas.addEventListener("focus", () => { describe(cursor); draw(); });
  canvas.addEventListener("blur", draw);
  window.addEventListener("resize", () => { computeLayout(); draw(); });

  // --- charts -----------------------------------------------------------------------------
  const series = { t: [], loss: [], rate: [], time: [] };
  const markers = config.markers.slice();
  const charts = [
    ["chart-loss", "loss", "Loss", "loss"],
    ["chart-rate", "rate", "Throughput", "samples/s"],
    ["chart-time", "time", "Step time", "s"],
  ];
  // The charts redraw at most every 2 s (the figures above them with every beat), and neither
  // while the tab is hidden nor while they are scrolled out of sight: each redraw of the three
  // is tens of milliseconds of the main thread.
  const REDRAW_MS = 2000;
  let plotted = 0, pending = null, stale = false, inSight = true;

  function shown() {
    const first = series.t[0];
    return markers.filter((m) => !first || new Date(m.at) >= new Date(first));
  }

  function markerShapes() {
    return shown().map((m) => ({
      type: "line", xref: "x", yref: "paper", x0: m.at, x1: m.at, y0: 0, y1: 1,
      line: { color: "#e15759", width: 1.5, dash: "dot" },
    }));
  }

  // each recovery marker labelled (#5 crash), the label its recovery's link
  function markerLabels() {
    return shown().map((m) => ({
      x: m.at, xref: "x", y: 1, yref: "paper", yanchor: "bottom", showarrow: false,
      text: m.decision ? `<a href="${config.recovery_url.replace("/0/", `/${m.decision}/`)}">${m.label}</a>` : m.label,
      font: { size: 10, color: "#b03a3c" },
    }));
  }

  // a flat series gets a range around its value, an empty one says so, rather than autoscale
  function yaxis(values, unit) {
    const axis = { title: { text: unit } };
    const known = values.filter((v) => v !== null && v !== undefined);
    if (known.length) {
      const low = Math.min(...known), high = Math.max(...known);
      if (high - low < 1e-12) {
        const pad = Math.abs(low) * 0.1 || 1;
        axis.range = [low - pad, high + pad];
      }
    }
    return axis;
  }

  // the page's own ink, so that the charts read in the dark theme too
  const ink = getComputedStyle(document.body).color;
  const gridLines = getComputedStyle(document.documentElement).getPropertyValue("--line").trim() || "#d8dde6";

  function plot() {
    if (!window.Plotly) return;
    const shapes = markerShapes(), labels = markerLabels();
    for (const [id, key, title, unit] of charts) {
      const empty = !series[key].some((v) => v !== null && v !== undefined);
      const note = empty ? [{ text: "no data yet", xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false, font: { color: "#7a8599" } }] : [];
      // copies: Plotly.react redraws only arrays it has not seen
      // one point is a dot in a minute's window, not a line of nothing on an axis of a millisecond
      const lone = series.t.length === 1;
      const around = lone ? [new Date(Date.parse(series.t[0]) - 30000).toISOString(), new Date(Date.parse(series.t[0]) + 30000).toISOString()] : undefined;
      Plotly.react(id, [{ x: series.t.slice(), y: series[key].slice(), mode: lone ? "markers" : "lines", line: { color: "#2457c5" }, marker: { color: "#2457c5" }, name: title }], {
        title: { text: title, font: { size: 14 } }, margin: { l: 50, r: 12, t: 32, b: 36 }, height: 260,
        xaxis: { type: "date", visible: !empty, gridcolor: gridLines, range: around, autorange: !lone },
        yaxis: { ...yaxis(series[key], unit), visible: !empty, gridcolor: gridLines },
        shapes, annotations: [...labels, ...note], showlegend: false,
        paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)", font: { color: ink },
      }, { displayModeBar: false, responsive: true });
    }
    plotted = Date.now();
    stale = false;
  }

  // --- the history kept on the server, over the range picked --------------------------------
  const range = document.getElementById("range"), rangeNote = document.getElementById("range-note");
  let rangeS = Number(range.value);

  // the points older than the range (none for the whole run), and beyond MOST_POINTS, dropped
  function trim() {
    const oldest = rangeS ? Date.now() - rangeS * 1000 : -Infinity;
    let drop = 0;
    while (drop < series.t.length && (Date.parse(series.t[drop]) < oldest || series.t.length - drop > MOST_POINTS)) drop++;
    if (drop) for (const key in series) series[key].splice(0, drop);
  }

  async function loadHistory() {
    const since = rangeS ? `?since=${encodeURIComponent(new Date(Date.now() - rangeS * 1000).toISOString())}` : "";
    try {
      const answer = await fetch(config.metrics_url + since, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (answer.status === 401) { document.dispatchEvent(new CustomEvent("pitstop:session-ended")); return; }
      if (!answer.ok) { rangeNote.textContent = `history unavailable (${answer.status})`; return; }
      const points = await answer.json();
      const kept = { t: [], loss: [], rate: [], time: [] }; // the history, then what came live after it
      for (const p of points) {
        kept.t.push(p.at); kept.loss.push(p.loss); kept.rate.push(p.samples_per_s); kept.time.push(p.step_time_s);
      }
      const last = kept.t.length ? Date.parse(kept.t[kept.t.length - 1]) : -Infinity;
      series.t.forEach((t, i) => {
        if (Date.parse(t) > last) { kept.t.push(t); kept.loss.push(series.loss[i]); kept.rate.push(series.rate[i]); kept.time.push(series.time[i]); }
      });
      Object.assign(series, kept);
      const coarse = points.filter((p) => p.span_s > 0).length;
      rangeNote.textContent = `${points.length} points kept on the server${coarse ? `, ${coarse} of them averaged over longer spans` : ""}`;
      trim();
      drawNow();
    } catch (error) {
      rangeNote.textContent = "history unavailable (the network)";
    }
  }
  range.addEventListener("change", () => { rangeS = Number(range.value); loadHistory(); });

  // at most every REDRAW_MS; while the tab is hidden or the charts out of sight only marked,
  // and drawn when they show
  function replot() {
    if (document.hidden || !inSight) { stale = true; return; }
    if (pending !== null) return;
    const wait = plotted + REDRAW_MS - Date.now();
    if (wait <= 0) { plot(); return; }
    pending = setTimeout(() => { pending = null; replot(); }, wait);
  }
  // a history asked for (the page's load, a range picked) is drawn at once, not at the next
  // redraw: the note above the charts and the charts agree
  function drawNow() {
    if (document.hidden || !inSight) { stale = true; return; }
    if (pending !== null) { clearTimeout(pending); pending = null; }
    plot();
  }
  document.addEventListener("visibilitychange", () => { if (!document.hidden && stale) replot(); });
  if ("IntersectionObserver" in window) {
    new IntersectionObserver((seen) => {
      inSight = seen.some((entry) => entry.isIntersecting);
      if (inSight && stale) replot();
    }).observe(document.querySelector(".charts"));
  }

  function text(id, value, digits, unit) {
    document.getElementById(id).textContent = value === null || value === undefined ? "—" : `${Number(value).toFixed(digits)}${unit}`;
  }

  function onLive(m) {
    beats = m.beats;
    text("stat-step", m.step, 0, "");
    text("stat-loss", m.loss, 4, "");
    text("stat-rate", m.samples_per_s, 2, " samples/s");
    text("stat-time", m.step_time_s, 3, " s");
    text("stat-nodes", m.nodes_connected, 0, "");
    const at = new Date(m.at * 1000).toISOString();
    if (m.step !== null && m.step !== undefined && at !== series.t[series.t.length - 1]) {
      series.t.push(at);
      series.loss.push(m.loss);
      series.rate.push(m.samples_per_s);
      series.time.push(m.step_time_s);
      trim();
      replot();
    }
    draw();
  }

  function onDevices(m) {
    const resized = m.states.length !== stored.length;
    stored = m.states;
    if (resized) computeLayout();
    const status = document.getElementById("job-status");
    status.textContent = m.job_status;
    status.className = `badge ${m.job_status}`;
    const d = m.decision, banner = document.getElementById("banner");
    if (d && !markers.some((x) => x.decision === d.id)) markers.push({ at: d.detected_at, label: `#${d.id} ${d.kind}`, decision: d.id });
    const open = d && !["recovered", "failed", "superseded", "dismissed"].includes(d.status);
    banner.classList.toggle("hidden", !open);
    if (open) {
      const link = config.recovery_url.replace("/0/", `/${d.id}/`);
      banner.innerHTML = "";
      banner.append("Decision ");
      const a = document.createElement("a");
      a.href = link;
      a.textContent = `#${d.id}`;
      banner.append(a, ` is ${d.status}${d.status === "proposed" ? ": it needs approval" : ""} (${d.kind}).`);
    }
    draw();
    replot();
  }

  // --- the server-drawn parts ---------------------------------------------------------------
  let fetching = false, again = false;
  async function refreshParts() {
    if (fetching) { again = true; return; } // one request at a time, the last change not lost
    fetching = true;
    try {
      const answer = await fetch(config.parts_url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (answer.status === 401) { document.dispatchEvent(new CustomEvent("pitstop:session-ended")); return; }
      if (!answer.ok) return;
      const parts = await answer.json();
      for (const element of document.querySelectorAll("[data-part]")) {
        const html = parts[element.dataset.part];
        if (html !== undefined && element.innerHTML !== html) element.innerHTML = html;
      }
    } catch (error) {
      // the network: the socket's next change asks again
    } finally {
      fetching = false;
      if (again) { again = false; refreshParts(); }
    }
  }

  function markStale(yes) {
    for (const element of document.querySelectorAll("#main section")) element.classList.toggle("stale", yes);
  }

  // 4401: the session ended; 4403: not allowed (any more); 4404: the job is gone. No retry.
  const FINAL = { 4401: "session ended", 4403: "not allowed", 4404: "the job was deleted" };

  // Whoever learns first that the session ended (this socket's 4401 or a page fetch's 401)
  // stops the live view: the socket is closed and not opened again.
  let socket = null, sessionOver = false;
  document.addEventListener("pitstop:session-ended", () => {
    if (sessionOver) return;
    sessionOver = true;
    markStale(true);
    document.getElementById("live-state").textContent = `stopped: ${FINAL[4401]}`;
    if (socket) socket.close();
  });

  function connect() {
    if (sessionOver) return;
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    socket = new WebSocket(`${scheme}://${location.host}${config.socket}`);
    const state = document.getElementById("live-state");
    socket.onopen = () => {
      state.textContent = "connected";
      markStale(false); // its first message is the devices', which draws the parts again
    };
    socket.onmessage = (event) => {
      const m = JSON.parse(event.data);
      if (m.type === "live") onLive(m);
      else if (m.type === "devices") { onDevices(m); refreshParts(); }
      else if (m.type === "expired") state.textContent = m.message;
      else if (m.type === "error") state.textContent = m.message;
    };
    socket.onclose = (event) => {
      markStale(true);
      if (sessionOver) return;
      if (event.code === 4401) { // the listener above stops the page
        document.dispatchEvent(new CustomEvent("pitstop:session-ended"));
        return;
      }
      if (event.code in FINAL) {
        state.textContent = `stopped: ${FINAL[event.code]}`;
        return;
      }
      state.textContent = "disconnected, retrying…";
      setTimeout(connect, 2000);
    };
  }

  computeLayout();
  draw();
  connect();
  loadHistory();
  window.pitstopCharts.whenPlotly(plot);
})();

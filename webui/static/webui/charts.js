// plotly.js (4.8 MB, 1.4 MB gzipped) is fetched and parsed after the page's load event, so
// the page (the grid, the figures, the tables) shows and goes live first; the charts are drawn
// when it arrives. Its address is the body's data-plotly (a path carrying plotly's version).
"use strict";
window.pitstopCharts = (function () {
  const waiting = [];
  let asked = false;

  function fetchIt() {
    const script = document.createElement("script");
    script.src = document.body.dataset.plotly;
    script.onload = () => { while (waiting.length) waiting.shift()(); };
    document.head.append(script);
  }

  // then() runs once plotly.js is there: at once if it is, else when it has loaded
  function whenPlotly(then) {
    if (window.Plotly) { then(); return; }
    waiting.push(then);
    if (asked) return;
    asked = true;
    if (document.readyState === "complete") fetchIt();
    else window.addEventListener("load", fetchIt, { once: true });
  }

  return { whenPlotly };
})();

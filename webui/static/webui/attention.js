// Every page of a logged-in user: the proposals waiting for an operator, counted in the tab's
// title ("(2) Jobs · Pitstop"), and each new one told by the browser's notification once the
// user allowed them (the header's "Notify me" button). Asked every 10 s, not while the tab is
// hidden (and at once when it shows again). A deadline on the page counts down every second.
// When the session ends (a logout in another tab, an expiry) the page says so: on this look's
// 401, or when another script sends "pitstop:session-ended" (the job page's socket closing).
"use strict";
(function () {
  const title = document.title;
  const button = document.getElementById("notify-me");
  const url = document.body.dataset.attention;
  let seen = null; // the ids waiting at the last look; null before the first
  let asking = false;

  function canNotify() {
    return "Notification" in window && Notification.permission === "granted";
  }

  function tell(waiting) {
    const note = new Notification(`Pitstop: recovery #${waiting.id} needs approval`, {
      body: `${waiting.job}${waiting.deadline_at ? `, applied at ${new Date(waiting.deadline_at).toLocaleTimeString()} if nobody decides` : ""}`,
      tag: `pitstop-recovery-${waiting.id}`,
    });
    note.onclick = () => { window.focus(); window.location.assign(waiting.url); };
  }

  async function look() {
    if (!url || asking || over || document.hidden) return;
    asking = true;
    try {
      const answer = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (answer.status === 401) { ended(); return; }
      if (!answer.ok) return; // the server away: the next look tries again
      const body = await answer.json();
      document.title = body.count ? `(${body.count}) ${title}` : title;
      if (seen !== null && canNotify()) {
        body.waiting.filter((w) => !seen.has(w.id)).forEach(tell);
      }
      seen = new Set(body.waiting.map((w) => w.id));
    } catch (error) {
      // the network: the next look tries again
    } finally {
      asking = false;
    }
  }

  let over = false;
  function ended() {
    if (over) return;
    over = true;
    const banner = document.getElementById("session-ended");
    if (banner) banner.hidden = false;
    document.title = `(session ended) ${title}`;
    document.body.classList.add("ended");
  }
  document.addEventListener("pitstop:session-ended", ended);

  if (button && "Notification" in window && Notification.permission === "default") {
    button.hidden = false;
    button.addEventListener("click", async () => {
      await Notification.requestPermission();
      button.hidden = Notification.permission !== "default";
    });
  }

  // "applied automatically in 1 min 05 s": every element with data-deadline
  function countDown() {
    for (const element of document.querySelectorAll("[data-deadline]")) {
      const left = Math.round((new Date(element.dataset.deadline) - Date.now()) / 1000);
      const minutes = Math.floor(Math.max(left, 0) / 60), seconds = Math.max(left, 0) % 60;
      element.textContent = left > 0
        ? `${minutes ? `${minutes} min ` : ""}${String(seconds).padStart(minutes ? 2 : 1, "0")} s`
        : "now (reload)";
    }
  }

  look();
  setInterval(look, 10000);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) look(); });
  if (document.querySelector("[data-deadline]")) { countDown(); setInterval(countDown, 1000); }
})();

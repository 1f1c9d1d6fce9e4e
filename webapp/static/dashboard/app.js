// The dashboard page: a hash router over three views (jobs overview, one job, submit)
// and the API key prompt when the server has auth on.
import { apiKey, authEnabled, forgetApiKey, setApiKey } from "./api.js";
import { el } from "./format.js";
import { closeJob, setupJob, showJob } from "./job.js";
import { filterStatus, setupJobs, startJobs } from "./jobs.js";
import { startSummary } from "./overview.js";
import { setupSubmit } from "./submit.js";

const VIEWS = ["auth-view", "overview-view", "job-view", "submit-view"];
let stopJobs = null;
let stopSummary = null;

function show(view) {
  for (const id of VIEWS) document.getElementById(id).hidden = id !== view;
}

function renderCounts(counts) {
  const box = document.getElementById("status-counts");
  box.replaceChildren(...Object.entries(counts).map(([status, count]) =>
    el("button", { type: "button", class: "chip", dataset: { status }, title: `show ${status}` },
       status, el("b", {}, count))));
}

function setLive(live) {
  const dot = document.getElementById("live-state");
  dot.className = live ? "live" : "stale";
  dot.title = live ? "live: updated every 2 s" : "updates failing; retrying";
}

function route() {
  if (authEnabled && !apiKey()) {
    stopAll();
    show("auth-view");
    document.getElementById("auth-key").focus();
    return;
  }
  document.getElementById("sign-out").hidden = !authEnabled;
  stopSummary ??= startSummary({ onCounts: renderCounts, onLive: setLive });
  const hash = location.hash || "#/";
  const jobMatch = hash.match(/^#\/jobs\/([0-9a-fA-F-]+)$/);
  for (const link of document.querySelectorAll("[data-nav]")) {
    link.classList.toggle("active", (link.dataset.nav === "submit") === (hash === "#/submit")
                                    && !jobMatch);
  }
  if (jobMatch) {
    stopJobs?.();
    stopJobs = null;
    show("job-view");
    showJob(jobMatch[1]);
  } else if (hash === "#/submit") {
    closeJob();
    stopJobs?.();
    stopJobs = null;
    show("submit-view");
  } else {
    closeJob();
    show("overview-view");
    stopJobs ??= startJobs();
  }
}

function stopAll() {
  closeJob();
  stopJobs?.();
  stopSummary?.();
  stopJobs = null;
  stopSummary = null;
}

function setupAuth() {
  document.getElementById("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = document.getElementById("auth-key").value.trim();
    if (!key) return;
    setApiKey(key);
    document.getElementById("auth-error").hidden = true;
    route();
  });
  document.getElementById("sign-out").addEventListener("click", () => {
    forgetApiKey();
    route();
  });
  document.addEventListener("llmq:unauthorized", (event) => {
    if (!authEnabled) return;
    forgetApiKey();
    const box = document.getElementById("auth-error");
    box.textContent = `The server refused the key: ${event.detail.message}`;
    box.hidden = false;
    route();
  });
}

setupAuth();
setupJobs();
setupJob();
setupSubmit();
document.getElementById("status-counts").addEventListener("click", (event) => {
  const chip = event.target.closest("[data-status]");
  if (!chip) return;
  if (location.hash && location.hash !== "#/") location.hash = "#/";
  filterStatus(chip.dataset.status);
});
window.addEventListener("hashchange", route);
route();

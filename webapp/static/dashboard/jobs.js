// The jobs view: filters, keyset paging, and a light poll of the current page so new and
// changed jobs show without a reload.
import { api, poll } from "./api.js";
import { clock, duration, el, shortId, statusBadge } from "./format.js";

const POLL_SECONDS = 2;
const PAGE_SIZE = 25;

const form = () => document.getElementById("job-filters");
let cursors = [null];   // the `after` cursor of each page visited; the last is the current
let lastPage = null;    // the newest answer, to page on
let seen = new Map();   // job id -> status, to mark new or changed rows
let stopPolling = null;

/** The listing's query string from the filter form (times sent as UTC ISO). */
function query() {
  const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
  const data = new FormData(form());
  for (const [name, value] of data.entries()) {
    if (!value) continue;
    if (name.startsWith("created_")) params.set(name, new Date(value).toISOString());
    else params.set(name, value);
  }
  const after = cursors[cursors.length - 1];
  if (after) params.set("after", after);
  return params.toString();
}

async function refresh() {
  const page = await api(`/v1/dashboard/jobs?${query()}`);
  lastPage = page;
  render(page);
}

function render(page) {
  const body = document.getElementById("jobs-body");
  const rows = page.data.map((job) => {
    const changed = seen.size > 0 && seen.get(job.id) !== job.status;
    const link = el("a", { href: `#/jobs/${job.id}` }, el("code", {}, shortId(job.id)));
    return el("tr", { class: changed ? "fresh" : null, dataset: { jobId: job.id,
                                                                  status: job.status } },
      el("td", {}, clock(job.created_at)),
      el("td", {}, link),
      el("td", {}, statusBadge(job.status)),
      el("td", {}, job.model),
      el("td", {}, job.kind),
      el("td", {}, job.api_key ?? "—"),
      el("td", { class: "prompt", title: job.prompt_preview ?? "" }, job.prompt_preview ?? ""),
      el("td", {}, `${job.prompt_tokens ?? "—"} / ${job.completion_tokens ?? "—"}`),
      el("td", {}, duration(job.queue_seconds)),
      el("td", {}, duration(job.ttft_seconds)),
      el("td", {}, duration(job.run_seconds)),
      el("td", {}, job.worker ?? "—"));
  });
  body.replaceChildren(...rows);
  seen = new Map(page.data.map((job) => [job.id, job.status]));
  document.getElementById("jobs-empty").hidden = page.data.length > 0;
  document.getElementById("page-newer").disabled = cursors.length <= 1;
  document.getElementById("page-older").disabled = !page.has_more;
  document.getElementById("page-label").textContent = `page ${cursors.length}`;
}

function restart() {
  seen = new Map();
  stopPolling?.();
  stopPolling = poll(refresh, POLL_SECONDS, (error) => console.warn("jobs:", error.message));
}

/** Set a filter from elsewhere (a status chip) and go back to the first page. */
export function filterStatus(status) {
  form().elements.status.value = status;
  cursors = [null];
  restart();
}

export function startJobs() {
  restart();
  return () => {
    stopPolling?.();
    stopPolling = null;
  };
}

export function setupJobs() {
  const filters = form();
  filters.addEventListener("change", () => {
    cursors = [null];
    if (stopPolling) restart();
  });
  filters.addEventListener("reset", () => setTimeout(() => filters.dispatchEvent(
    new Event("change")), 0));
  filters.addEventListener("submit", (event) => event.preventDefault());
  document.getElementById("page-older").addEventListener("click", () => {
    if (!lastPage?.has_more) return;
    cursors.push(lastPage.last_id);
    restart();
  });
  document.getElementById("page-newer").addEventListener("click", () => {
    if (cursors.length <= 1) return;
    cursors.pop();
    restart();
  });
}

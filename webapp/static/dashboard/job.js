// The job view: the request, parameters, timings and placement, and its text streaming
// live from the job's events (replayed from the start, resumed after a drop).
import { api, authEnabled, poll } from "./api.js";
import { clock, duration, el, statusBadge } from "./format.js";
import { followEvents } from "./sse.js";

const POLL_SECONDS = 2;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

let current = null; // {id, stream, stopPolling, texts, restarts, job}

export function showJob(jobId) {
  closeJob();
  const state = { id: jobId, texts: new Map(), restarts: 0, job: null, ended: false };
  current = state;
  document.getElementById("job-id").textContent = jobId;
  document.getElementById("job-status").replaceChildren();
  document.getElementById("job-error").hidden = true;
  document.getElementById("job-outputs").replaceChildren();
  document.getElementById("job-raw-json").hidden = true;
  document.getElementById("job-raw").href = `/v1/jobs/${encodeURIComponent(jobId)}`;
  document.getElementById("job-cancel").disabled = true;
  setStreamState("connecting…");

  state.stopPolling = poll(async () => {
    const job = await api(`/v1/dashboard/jobs/${encodeURIComponent(jobId)}`);
    if (current !== state) return;
    state.job = job;
    renderJob(state);
    if (TERMINAL.has(job.status) && state.ended) state.stopPolling();
  }, POLL_SECONDS, (error) => {
    if (current !== state) return;
    if (error.status === 404) state.stopPolling(); // it will not appear later
    showError(error.status === 404 ? `No job ${jobId} (or not one of this key's jobs).`
                                   : error.message);
  });

  state.stream = followEvents(jobId, {
    onEvent: (event) => current === state && onEvent(state, event),
    onState: (name, detail) => {
      if (current !== state) return;
      const labels = { open: "streaming", ended: "complete",
                       reconnecting: `reconnecting (after event ${detail ?? "none"})…`,
                       failed: `event stream refused (HTTP ${detail})` };
      setStreamState(labels[name] ?? name);
      if (name === "ended") {
        state.ended = true;
        document.getElementById("job-outputs").dataset.complete = "true";
      }
    },
  });
}

export function closeJob() {
  if (!current) return;
  current.stopPolling?.();
  current.stream?.close();
  current = null;
}

function onEvent(state, { event, data }) {
  if (event === "token") {
    const index = data.index ?? 0;
    state.texts.set(index, (state.texts.get(index) ?? "") + (data.text ?? ""));
  } else if (event === "restart") {
    // the output so far is void: the job starts over (another attempt)
    state.texts.clear();
    state.restarts += 1;
  } else {
    // terminal: the row has the final figures; read it now rather than at the next poll
    api(`/v1/dashboard/jobs/${encodeURIComponent(state.id)}`).then((job) => {
      if (current !== state) return;
      state.job = job;
      renderJob(state);
    }).catch(() => {});
  }
  renderOutputs(state);
}

function renderOutputs(state) {
  const box = document.getElementById("job-outputs");
  const indexes = [...state.texts.keys()].sort((a, b) => a - b);
  if (!indexes.length) indexes.push(0);
  box.replaceChildren(...indexes.flatMap((index) => [
    indexes.length > 1 ? el("div", { class: "output-label" }, `sample ${index}`) : null,
    el("pre", { class: "output", dataset: { sample: index } }, state.texts.get(index) ?? ""),
  ].filter(Boolean)));
}

function renderJob(state) {
  const job = state.job;
  const request = job.request;
  document.getElementById("job-status").replaceChildren(statusBadge(job.status));
  document.getElementById("job-cancel").disabled = TERMINAL.has(job.status);
  const t = job.timings;
  const usage = job.usage ?? {};
  const facts = [
    ["model", job.model], ["kind", job.kind], ["priority", job.priority],
    ["key", request.api_key ?? "—"],
    ["worker / group", request.worker ?? "—"],
    ["attempts", job.attempts],
    ["restarts", `${request.num_restarts}` + (state.restarts ? ` (${state.restarts} seen live)` : "")],
    ["created", clock(job.created_at)],
    ["queue", duration(t.queue_seconds)],
    ["TTFT", duration(t.time_to_first_token_seconds)],
    ["run", duration(t.run_seconds)],
    ["total", duration(t.total_seconds)],
    ["tokens", `${usage.prompt_tokens ?? "—"} prompt, ${usage.completion_tokens ?? "—"} completion`],
    ["cached tokens", usage.cached_tokens ?? "—"],
    ["finish reason", job.finish_reason ?? "—"],
  ];
  document.getElementById("job-facts").replaceChildren(...facts.flatMap(([name, value]) => [
    el("dt", {}, name), el("dd", { dataset: { fact: name } }, value)]));
  document.getElementById("job-params").textContent = JSON.stringify(job.params, null, 1);
  document.getElementById("job-request").textContent = request.messages
    ? request.messages.map((m) => `${m.role}: ${typeof m.content === "string"
      ? m.content : JSON.stringify(m.content)}`).join("\n")
    : (request.prompt ?? `(${request.num_prompt_tokens} prompt token ids)`);
  if (job.error) showError(job.error);
  if (!state.texts.size && TERMINAL.has(job.status) && state.ended && job.text) {
    // the stream expired: the row still has the result
    state.texts.set(0, job.text);
    renderOutputs(state);
  }
}

function setStreamState(text) {
  document.getElementById("stream-state").textContent = text;
}

function showError(message) {
  const box = document.getElementById("job-error");
  box.textContent = message;
  box.hidden = false;
}

export function setupJob() {
  document.getElementById("job-cancel").addEventListener("click", async (event) => {
    if (!current) return;
    event.target.disabled = true;
    try {
      await api(`/v1/jobs/${encodeURIComponent(current.id)}/cancel`, { method: "POST" });
    } catch (error) {
      showError(`cancel: ${error.message}`);
      event.target.disabled = false;
    }
  });
  document.getElementById("job-raw").addEventListener("click", async (event) => {
    if (!authEnabled || !current) return; // without auth the link opens the API itself
    // NOTE: a plain link cannot carry the key; fetch it and show it here instead
    event.preventDefault();
    const box = document.getElementById("job-raw-json");
    box.textContent = JSON.stringify(await api(`/v1/jobs/${encodeURIComponent(current.id)}`),
                                     null, 2);
    box.hidden = false;
  });
}

// The overview's live panels: counts per status, device groups, queues and rate charts,
// all from one poll of /v1/dashboard/summary.
import { api, poll } from "./api.js";
import { RingBuffer, drawChart } from "./charts.js";
import { ago, el, number } from "./format.js";

const POLL_SECONDS = 2;
const SPAN_SECONDS = 300;   // the charts show the last five minutes
const RATE_WINDOW_SECONDS = 10;     // rates over this window (smooths the heartbeats)
const LATENCY_WINDOW_SECONDS = 60;  // latencies: the mean of the jobs finished in it

const samples = new RingBuffer(Math.ceil(SPAN_SECONDS / POLL_SECONDS) + 8); // cumulative
const series = {
  tokens: new RingBuffer(samples.capacity),
  jobs: new RingBuffer(samples.capacity),
  ttft: new RingBuffer(samples.capacity),
  itl: new RingBuffer(samples.capacity),
};

/** Start polling; `onCounts(counts)` hears the status counts of each round. */
export function startSummary({ onCounts, onLive }) {
  return poll(async () => {
    const summary = await api("/v1/dashboard/summary");
    onCounts(summary.counts);
    renderGroups(summary.models);
    renderQueues(summary.models);
    addSample(summary);
    onLive(true);
  }, POLL_SECONDS, () => onLive(false));
}

function totals(models) {
  const sum = { generation_tokens: 0, finished_jobs: 0, ttft_sum: 0, ttft_count: 0,
                itl_sum: 0, itl_count: 0 };
  for (const model of models) {
    for (const name of Object.keys(sum)) sum[name] += model.counters?.[name] ?? 0;
  }
  return sum;
}

function addSample(summary) {
  const now = { t: summary.time, ...totals(summary.models) };
  samples.push(now);
  const then = samples.since(RATE_WINDOW_SECONDS);
  const before = samples.since(LATENCY_WINDOW_SECONDS);
  const seconds = now.t - then.t;
  const delta = (name) => now[name] - then[name];
  const ratio = (sum, count) => (now[count] > before[count]
    ? (now[sum] - before[sum]) / (now[count] - before[count]) : null);
  const values = {
    tokens: seconds > 0 ? delta("generation_tokens") / seconds : 0,
    jobs: seconds > 0 ? delta("finished_jobs") / seconds : 0,
    ttft: ratio("ttft_sum", "ttft_count"),
    itl: ((v) => (v === null ? null : v * 1000))(ratio("itl_sum", "itl_count")),
  };
  for (const [name, value] of Object.entries(values)) {
    series[name].push({ t: now.t, value });
    const chart = document.querySelector(`[data-chart="${name}"]`);
    if (chart) drawChart(chart, series[name], SPAN_SECONDS);
    const label = document.querySelector(`[data-rate="${name}"]`);
    if (label) label.textContent = number(value, name === "ttft" ? 3 : 1);
  }
}

function renderGroups(models) {
  const body = document.getElementById("groups-body");
  const rows = [];
  for (const model of models) {
    if (model.groups === null) {
      rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" },
                                 `${model.name}: Redis unreachable`)));
      continue;
    }
    for (const group of model.groups) {
      const usage = Math.round((group.kv_cache_usage ?? 0) * 100);
      rows.push(el("tr", { dataset: { group: group.id } },
        el("td", {}, el("code", {}, group.id)),
        el("td", {}, group.model),
        el("td", {}, group.devices.join(", ")),
        el("td", {}, group.tp_size),
        el("td", {}, group.num_running),
        el("td", {}, group.num_waiting),
        el("td", { title: `${usage}% of KV blocks in use` },
           el("span", { class: "kv" }, el("span", { style: `width:${usage}%` })), ` ${usage}%`),
        el("td", {}, ago(group.heartbeat_age_seconds)),
        el("td", { class: `health ${group.healthy ? "ok" : "bad"}` },
           group.healthy ? "healthy" : (group.draining ? "draining" : "stale"))));
    }
  }
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: 9, class: "muted" },
                               "No device group is heartbeating. Start one: llmq worker")));
  }
  body.replaceChildren(...rows);
}

function renderQueues(models) {
  const body = document.getElementById("queues-body");
  body.replaceChildren(...models.map((model) => el("tr", { dataset: { model: model.name } },
    el("td", {}, model.name),
    el("td", {}, model.queued),
    el("td", {}, model.broker_pending ?? "—"),
    el("td", {}, model.running),
    el("td", {}, model.groups ? model.groups.filter((g) => g.alive).length : "—"))));
}

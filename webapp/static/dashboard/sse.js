// A job's server-sent events read with fetch() and a streaming reader: EventSource cannot
// send the Authorization header. Like EventSource, it reconnects after a drop and sends
// Last-Event-ID, so the server resumes exactly after the last event received.
import { authHeaders } from "./api.js";

const TERMINAL = new Set(["done", "error", "cancelled"]);

/** Parse one SSE block (the lines between blank lines) into {id, event, data, retry}. */
function parseBlock(block) {
  const fields = { data: [] };
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "data") fields.data.push(value);
    else fields[name] = value;
  }
  return fields;
}

/**
 * Follow `/v1/jobs/<id>/events` until its terminal event.
 * onEvent({id, event, data}) gets each event (data parsed); onState(state, detail) hears
 * "open", "reconnecting", "ended" and "failed" (a 4xx answer: no point retrying).
 * Returns {close()}.
 */
export function followEvents(jobId, { onEvent, onState = () => {} }) {
  let lastId = null;
  let retryMs = 2000;
  let closed = false;
  let controller = null;

  async function readOnce() {
    controller = new AbortController();
    const headers = { Accept: "text/event-stream", ...authHeaders() };
    if (lastId) headers["Last-Event-ID"] = lastId;
    const response = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/events`,
                                 { headers, signal: controller.signal });
    if (response.status >= 400 && response.status < 500 && response.status !== 429) {
      onState("failed", response.status);
      return true;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    onState("open");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false; // dropped before the terminal event: reconnect
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const fields = parseBlock(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (fields.retry && /^\d+$/.test(fields.retry)) retryMs = Number(fields.retry);
        if (fields.id) lastId = fields.id;
        if (!fields.event) continue;
        const data = fields.data.length ? JSON.parse(fields.data.join("\n")) : {};
        onEvent({ id: fields.id ?? null, event: fields.event, data });
        if (TERMINAL.has(fields.event)) {
          controller.abort();
          return true;
        }
      }
    }
  }

  (async () => {
    while (!closed) {
      let finished = false;
      try {
        finished = await readOnce();
      } catch (error) {
        if (closed) return;
      }
      if (finished) {
        closed = true;
        onState("ended");
        return;
      }
      if (closed) return;
      onState("reconnecting", lastId);
      await new Promise((resolve) => setTimeout(resolve, retryMs));
    }
  })();

  return {
    close() {
      closed = true;
      controller?.abort();
    },
    get lastEventId() {
      return lastId;
    },
  };
}

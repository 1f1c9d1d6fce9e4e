// The API as the page calls it: JSON over fetch, with the tab's API key when auth is on.
const KEY_STORAGE = "llmq.apiKey";

export const authEnabled = document.body.dataset.auth === "true";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY_STORAGE, key);
}

export function forgetApiKey() {
  sessionStorage.removeItem(KEY_STORAGE);
}

/** Headers every call carries: `Authorization: Bearer <key>` when auth is on. */
export function authHeaders() {
  const key = apiKey();
  return authEnabled && key ? { Authorization: `Bearer ${key}` } : {};
}

export class ApiError extends Error {
  constructor(status, body) {
    const message = body?.error?.message ?? `HTTP ${status}`;
    super(message);
    this.status = status;
    this.body = body;
  }
}

/** Call the API; resolves to the JSON body, rejects with an ApiError. A 401 also tells
 * the page (event `llmq:unauthorized`) so it can ask for a key again. */
export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = { Accept: "application/json", ...authHeaders() };
  const init = { method, headers, signal };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const error = new ApiError(response.status, data);
    if (response.status === 401) {
      document.dispatchEvent(new CustomEvent("llmq:unauthorized", { detail: error }));
    }
    throw error;
  }
  return data;
}

/** Run `task` now and every `seconds` until the returned stop() is called; a failing
 * round is reported to `onError` and the polling goes on. */
export function poll(task, seconds, onError = () => {}) {
  let timer = null;
  let stopped = false;
  async function round() {
    try {
      await task();
    } catch (error) {
      onError(error);
    }
    if (!stopped) timer = setTimeout(round, seconds * 1000);
  }
  round();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

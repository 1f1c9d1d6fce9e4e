// Small DOM and number helpers shared by the views. Text always goes in as textContent.

/** Build an element: el("td", {class: "x"}, "text", childNode, ...). */
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function statusBadge(status) {
  return el("span", { class: `status ${status}` }, status);
}

/** Seconds as "412 ms" / "3.2 s" / "—". */
export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(1)} s`;
  return `${(seconds / 60).toFixed(1)} min`;
}

/** An ISO time as local "HH:MM:SS" (with the date when not today). */
export function clock(iso) {
  if (!iso) return "—";
  const moment = new Date(iso);
  const time = moment.toLocaleTimeString([], { hour12: false });
  return moment.toDateString() === new Date().toDateString()
    ? time : `${moment.toLocaleDateString()} ${time}`;
}

export function ago(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return seconds < 1 ? "just now" : `${seconds.toFixed(1)} s ago`;
}

export function number(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  return Math.abs(value) >= 100 ? Math.round(value).toString() : value.toFixed(digits);
}

export function shortId(id) {
  return id.slice(0, 8);
}

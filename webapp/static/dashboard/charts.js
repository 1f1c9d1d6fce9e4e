// Rates drawn as small SVG charts from a ring buffer of samples kept in the page.
const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 300;   // the charts' viewBox (CSS stretches it)
const HEIGHT = 70;
const PAD = 4;

/** The last `capacity` samples {t (unix seconds), value (number | null)}, oldest first. */
export class RingBuffer {
  constructor(capacity) {
    this.capacity = capacity;
    this.items = [];
  }

  push(item) {
    this.items.push(item);
    if (this.items.length > this.capacity) this.items.shift();
  }

  get last() {
    return this.items[this.items.length - 1];
  }

  /** The oldest sample no older than `seconds` before the newest (the window's start). */
  since(seconds) {
    const newest = this.last;
    if (!newest) return undefined;
    return this.items.find((item) => newest.t - item.t <= seconds);
  }
}

/** Draw `samples` (a RingBuffer of {t, value}) into `svg` over the last `spanSeconds`
 * (or since the first sample, while the page is younger than that); a null value breaks
 * the line (no data then, e.g. no job finished). */
export function drawChart(svg, samples, maxSpanSeconds) {
  const items = samples.items;
  svg.replaceChildren();
  if (!items.length) return;
  const end = items[items.length - 1].t;
  const start = Math.max(end - maxSpanSeconds, items[0].t);
  const spanSeconds = Math.max(end - start, 1e-9);
  const values = items.map((item) => item.value).filter((v) => v !== null);
  const top = Math.max(...values, 1e-9) * 1.15;
  const x = (t) => ((t - start) / spanSeconds) * WIDTH;
  const y = (v) => HEIGHT - PAD - (v / top) * (HEIGHT - 2 * PAD);
  let line = "";
  let area = "";
  let segment = [];
  const flush = () => {
    if (!segment.length) return;
    // a lone value still shows: a short level stroke ending at it
    if (segment.length === 1) segment.unshift([segment[0][0] - 3, segment[0][1]]);
    line += segment.map(([px, py], i) => `${i ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`)
      .join("");
    const first = segment[0][0].toFixed(1);
    const last = segment[segment.length - 1][0].toFixed(1);
    area += `M${first},${HEIGHT}` + segment.map(([px, py]) => `L${px.toFixed(1)},${py.toFixed(1)}`)
      .join("") + `L${last},${HEIGHT}Z`;
    segment = [];
  };
  for (const item of items) {
    if (item.t < start) continue;
    if (item.value === null) flush();
    else segment.push([x(item.t), y(item.value)]);
  }
  flush();
  for (const [cls, d] of [["area", area], ["line", line]]) {
    if (!d) continue;
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("class", cls);
    path.setAttribute("d", d);
    svg.append(path);
  }
}

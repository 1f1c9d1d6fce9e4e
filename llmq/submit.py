"""`llmq submit`: a small client that submits a job and prints its tokens as they stream."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def cmd_submit(args: argparse.Namespace) -> int:
    import requests

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or _first_model(url, headers)
        body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens}
        if args.chat:
            body["messages"] = [{"role": "user", "content": args.prompt}]
        else:
            body["prompt"] = args.prompt
        for name in ("temperature", "seed"):
            if getattr(args, name) is not None:
                body[name] = getattr(args, name)
        response = requests.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=60)
        if response.status_code >= 400:
            return _print_api_error(response)
        job = response.json()
        print(f"job {job['id']} {job['status']}", file=sys.stderr)
        with requests.get(url + job["links"]["events"], headers=headers, stream=True,
                          timeout=(10, 300)) as stream:
            if stream.status_code >= 400:
                return _print_api_error(stream)
            return _print_events(iter_sse(stream.iter_lines(decode_unicode=True)))
    except requests.ConnectionError:
        print(f"error: cannot reach the API at {url}: start the stack with `llmq up`, or "
              "pass --url (or set LLMQ_URL) to reach one running elsewhere", file=sys.stderr)
        return 1


def _first_model(url: str, headers: dict[str, str]) -> str:
    import requests

    response = requests.get(f"{url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    models = [m["id"] for m in response.json()["data"]]
    if not models:
        raise ValueError("the server serves no models (set LLMQ_MODELS on the server)")
    return models[0]


def _print_events(events: Iterator[tuple[str, dict[str, Any]]],
                  write: Callable[[str], Any] = sys.stdout.write) -> int:
    for event_type, data in events:
        if event_type == "token" and data.get("index", 0) == 0:
            write(data.get("text", ""))
            sys.stdout.flush()
        elif event_type == "restart":
            print(f"\n[the job restarts (attempt {data.get('attempt')}); output so far is void]",
                  file=sys.stderr)
        elif event_type == "done":
            write("\n")
            print(f"[{data.get('finish_reason')}; usage {json.dumps(data.get('usage'))}]",
                  file=sys.stderr)
            return 0
        elif event_type in ("error", "cancelled"):
            write("\n")
            print(f"[{event_type}: {data.get('error') or data.get('finish_reason')}]",
                  file=sys.stderr)
            return 1
    print("\n[the event stream ended before the job did]", file=sys.stderr)
    return 1


def iter_sse(lines: Iterator[str | bytes]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, data) pairs of a server-sent event stream; comments are skipped."""
    event_type, data = "message", ""
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line:
            if data:
                yield event_type, json.loads(data)
            event_type, data = "message", ""
        elif line.startswith("event:"):
            event_type = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()


def _print_api_error(response: Any) -> int:
    try:
        error = response.json()["error"]
        message = f"{error['message']} ({error['code']})"
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    print(f"error: HTTP {response.status_code}: {message}", file=sys.stderr)
    return 1

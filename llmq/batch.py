"""`llmq batch submit | status | results`: a client of the Batch API (`/v1/files`,
`/v1/batches`), with a progress bar while it waits at a terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from llmq.submit import _print_api_error as print_api_error

FINISHED = ("completed", "failed", "expired", "cancelled")
POLL_SECONDS = 1.0


class _Api:
    """The API at `url` with the caller's key; raises SystemExit-free `ApiError`s."""

    def __init__(self, args: argparse.Namespace) -> None:
        import requests

        self.requests = requests
        self.url = args.url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.requests.request(method, self.url + path, headers=self.headers,
                                         timeout=300, **kwargs)
        if response.status_code >= 400:
            print_api_error(response)
            raise _Failed
        return response


class _Failed(Exception):
    """The API answered an error (already printed)."""


def cmd_batch(args: argparse.Namespace) -> int:
    import requests

    try:
        return int(args.batch_handler(_Api(args), args) or 0)
    except _Failed:
        return 1
    except requests.ConnectionError:
        print(f"error: cannot reach the API at {args.url}: start the stack with `llmq up`, "
              "or pass --url (or set LLMQ_URL)", file=sys.stderr)
        return 1


def batch_submit(api: _Api, args: argparse.Namespace) -> int:
    """Upload FILE, create the batch, print its id, wait out its validation (a batch
    with invalid lines fails: they are printed); with --wait, follow it to the end."""
    with open(args.file, "rb") as handle:
        upload = api.call("POST", "/v1/files", data={"purpose": "batch"},
                          files={"file": (args.file.rsplit("/", 1)[-1], handle)}).json()
    batch = api.call("POST", "/v1/batches", json={
        "input_file_id": upload["id"], "endpoint": args.endpoint,
        "completion_window": "24h"}).json()
    print(batch["id"])
    while batch["status"] == "validating":  # the server checks the lines off the request
        time.sleep(POLL_SECONDS / 4)
        batch = api.call("GET", f"/v1/batches/{batch['id']}").json()
    if batch["status"] == "failed":
        _print_errors(batch)
        return 1
    if not args.wait:
        return 0
    return _report(_follow(api, batch))


def batch_status(api: _Api, args: argparse.Namespace) -> int:
    batch = api.call("GET", f"/v1/batches/{args.batch_id}").json()
    if args.wait and batch["status"] not in FINISHED:
        batch = _follow(api, batch)
    return _report(batch)


def batch_results(api: _Api, args: argparse.Namespace) -> int:
    """The output file's lines (and the error file's) to stdout or -o FILE."""
    batch = api.call("GET", f"/v1/batches/{args.batch_id}").json()
    if batch["status"] not in FINISHED:
        batch = _follow(api, batch)
    out = open(args.output, "wb") if args.output else sys.stdout.buffer
    try:
        for name in ("output_file_id", "error_file_id"):
            if batch.get(name):
                out.write(api.call("GET", f"/v1/files/{batch[name]}/content").content)
    finally:
        if args.output:
            out.close()
    counts = batch["request_counts"]
    print(f"{batch['id']} {batch['status']}: {counts['completed']} completed, "
          f"{counts['failed']} failed of {counts['total']}", file=sys.stderr)
    return 0 if batch["status"] == "completed" and not counts["failed"] else 1


def _follow(api: _Api, batch: dict[str, Any]) -> dict[str, Any]:
    """Poll until the batch ends; a progress bar at a terminal."""
    bar = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=batch["request_counts"]["total"], unit="req", desc=batch["id"][:18],
                   file=sys.stderr)
    try:
        while batch["status"] not in FINISHED:
            time.sleep(POLL_SECONDS)
            batch = api.call("GET", f"/v1/batches/{batch['id']}").json()
            if bar is not None:
                counts = batch["request_counts"]
                bar.update(counts["completed"] + counts["failed"] - bar.n)
                bar.set_postfix(status=batch["status"], failed=counts["failed"])
    finally:
        if bar is not None:
            bar.close()
    return batch


def _report(batch: dict[str, Any]) -> int:
    print(json.dumps(batch, indent=2))
    _print_errors(batch)
    return 0 if batch["status"] in ("completed", "validating", "in_progress",
                                    "finalizing") else 1


def _print_errors(batch: dict[str, Any]) -> None:
    for error in (batch.get("errors") or {}).get("data", []):
        print(f"line {error.get('line')}: {error['message']} ({error['code']})",
              file=sys.stderr)


def add_batch_parser(sub: Any, command: Any, default_url: str, api_key: str | None) -> None:
    """`llmq batch ...` on the CLI's subparsers."""
    batch = command(sub, "batch", help="submit a file of requests as a batch, follow it, "
                    "fetch its results (OpenAI's Batch API)",
                    description="The Batch API from the command line: a JSONL file of "
                    '{"custom_id", "method": "POST", "url", "body"} lines.')
    actions = batch.add_subparsers(title="batch commands", metavar="ACTION")

    def action(name: str, handler: Any, help: str) -> argparse.ArgumentParser:
        parser = command(actions, name, help=help, description=help)
        parser.add_argument("--url", default=default_url, help="the API's base URL ($LLMQ_URL)")
        parser.add_argument("--api-key", default=api_key,
                            help="API key when the server requires one ($LLMQ_API_KEY)")
        parser.set_defaults(handler=cmd_batch, batch_handler=handler)
        return parser

    submit = action("submit", batch_submit, "upload FILE and create a batch; prints its id")
    submit.add_argument("file", help="the JSONL file of requests")
    submit.add_argument("--endpoint", default="/v1/chat/completions",
                        choices=["/v1/chat/completions", "/v1/completions"],
                        help="the endpoint every line calls")
    submit.add_argument("--wait", action="store_true",
                        help="follow the batch to its end (a progress bar at a terminal)")
    status = action("status", batch_status, "show a batch (status, request counts, files)")
    status.add_argument("batch_id")
    status.add_argument("--wait", action="store_true", help="follow the batch to its end")
    results = action("results", batch_results, "write a batch's output and error lines "
                     "(waits for the batch to end)")
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", help="write to this file instead of stdout")

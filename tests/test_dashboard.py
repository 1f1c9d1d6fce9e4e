"""The dashboard driven in a real browser: Debian's chromium through Playwright, over the
Flask app served on HTTP, real Postgres and Redis, and a real device-group worker.

Set `LLMQ_SCREENSHOTS_DIR` to save screenshots of the pages (docs/images/ holds the ones
the README shows); without it nothing is written.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
import requests
from sqlalchemy import func, select

from tasks.auth import create_api_key
from tasks.models import Job, JobStatus
from tests.browser_helpers import DroppingProxy, Tab, chromium_executable
from tests.pipeline_helpers import get_job, read_job, running_worker, submit, wait_terminal

pytestmark = pytest.mark.integration

WORKER_ARGS = ["--max-num-seqs", "8", "--kv-cache-bytes", str(16 * 1024 * 1024)]
# a job that runs several seconds on the tiny model, even on an idle machine: the page
# opens, streams and can cancel well before its end
STREAMED_TOKENS = 1500
LONG = {"max_tokens": STREAMED_TOKENS, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    exe = chromium_executable()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # NOTE: no browser download happens here: Playwright drives the system chromium.
        instance = playwright.chromium.launch(executable_path=exe, headless=True)
        yield instance
        instance.close()


@pytest.fixture(scope="module")
def worker(service_settings, redis_client, tmp_path_factory):
    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "dash", args=WORKER_ARGS) as process:
        yield process



@pytest.fixture
def tab(browser, base_url) -> Iterator[Tab]:
    opened = Tab(browser, base_url)
    yield opened
    opened.close()


def _row(tab: Tab, job_id: str):
    return tab.page.locator(f'#jobs-body tr[data-job-id="{job_id}"]')


def _wait_stream_complete(tab: Tab) -> str:
    tab.page.wait_for_selector('#job-outputs[data-complete="true"]')
    return tab.page.locator("#job-outputs pre.output").first.text_content() or ""


def test_page_is_served_with_its_static_files(base_url):
    page = requests.get(base_url + "/", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["Content-Type"]
    assets = re.findall(r'(?:href|src)="(/static/dashboard/[^"]+)"', page.text)
    assert {a.split("?")[0].rsplit("/", 1)[-1] for a in assets} == {"dashboard.css", "app.js"}
    for asset in assets:
        response = requests.get(base_url + asset, timeout=30)
        assert response.status_code == 200, asset
    # the modules app.js imports are shipped too
    for name in ("api.js", "sse.js", "charts.js", "jobs.js", "job.js", "overview.js",
                 "submit.js", "format.js"):
        response = requests.get(f"{base_url}/static/dashboard/{name}", timeout=30)
        assert response.status_code == 200 and "javascript" in response.headers["Content-Type"]


def test_dashboard_api_filters_and_pages(base_url, session_factory):
    marker = uuid.uuid4().hex[:8]
    ids = [submit(base_url, prompt=f"{marker} {i}", max_tokens=1)["id"] for i in range(3)]
    listed = requests.get(f"{base_url}/v1/dashboard/jobs?limit=100&kind=completion",
                          timeout=30).json()
    assert [j["id"] for j in listed["data"] if (j["prompt_preview"] or "").startswith(marker)] \
        == ids[::-1]
    page = requests.get(f"{base_url}/v1/dashboard/jobs?limit=1&after={ids[2]}",
                        timeout=30).json()
    assert page["data"][0]["id"] == ids[1] and page["has_more"] is True
    none = requests.get(f"{base_url}/v1/dashboard/jobs?model=nope", timeout=30).json()
    assert none["data"] == [] and none["has_more"] is False
    future = requests.get(f"{base_url}/v1/dashboard/jobs?created_after=2999-01-01T00:00:00Z",
                          timeout=30).json()
    assert future["data"] == []
    for query, param in (("status=bogus", "status"), ("kind=x", "kind"), ("limit=0", "limit"),
                         ("created_before=yesterday", "created_before"),
                         ("after=not-a-uuid", "after")):
        response = requests.get(f"{base_url}/v1/dashboard/jobs?{query}", timeout=30)
        assert response.status_code == 400, query
        assert response.json()["error"]["param"] == param
    summary = requests.get(f"{base_url}/v1/dashboard/summary", timeout=30).json()
    with session_factory() as session:
        total = session.scalar(select(func.count()).select_from(Job))
    assert sum(summary["counts"].values()) == total
    assert set(summary["counts"]) == {s.value for s in JobStatus}
    assert [m["name"] for m in summary["models"]] == ["tiny"]


def test_submitted_job_appears_without_reload(tab, worker, session_factory):
    tab.open()
    # the first listing rendered: its rows, or its note that no job matches (run alone)
    tab.page.wait_for_selector("#jobs-body tr, #jobs-empty:not([hidden])")
    tab.page.evaluate("window.__notReloaded = true")
    job = submit(tab.base_url, prompt="appears live", max_tokens=8, temperature=0.0)
    row = _row(tab, job["id"])
    row.wait_for()
    wait_terminal(session_factory, job["id"])
    tab.page.wait_for_selector(f'#jobs-body tr[data-job-id="{job["id"]}"][data-status="succeeded"]')
    assert tab.page.evaluate("window.__notReloaded") is True
    assert "appears live" in row.text_content()
    # the counts follow the database
    tab.page.wait_for_function(
        "n => Number(document.querySelector('[data-status=succeeded] b').textContent) >= n", arg=1)
    tab.assert_no_errors()


def test_job_page_streams_to_the_stored_text(tab, worker, session_factory):
    # long enough that the page opens well before the end, even on a loaded machine
    job = submit(tab.base_url, prompt="stream me", max_tokens=STREAMED_TOKENS,
                 ignore_eos=True, temperature=0.0)
    tab.open(f"#/jobs/{job['id']}")
    # text shows while the job still runs: it comes from the live events, not the row
    tab.page.wait_for_function(
        "() => document.querySelector('#job-outputs pre.output')?.textContent.length > 0")
    partial = tab.page.locator("#job-outputs pre.output").text_content()
    assert read_job(session_factory, job["id"]).status == JobStatus.RUNNING.value
    text = _wait_stream_complete(tab)
    stored = read_job(session_factory, job["id"])
    assert stored.status == JobStatus.SUCCEEDED.value
    assert stored.completion_tokens == STREAMED_TOKENS
    assert text == get_job(tab.base_url, job["id"])["text"] and text.startswith(partial)
    assert len(text) > len(partial)
    tab.page.wait_for_selector('#job-status .status.succeeded')
    facts = tab.page.locator("#job-facts")
    assert worker.group_id in facts.locator('[data-fact="worker / group"]').text_content()
    assert facts.locator('[data-fact="attempts"]').text_content() == "1"
    assert "stream me" in tab.page.locator("#job-request").text_content()
    assert tab.page.locator("#job-raw").get_attribute("href") == f"/v1/jobs/{job['id']}"
    tab.screenshot("dashboard-job")
    tab.assert_no_errors()


def test_cancel_from_the_button(tab, worker, session_factory):
    job = submit(tab.base_url, prompt="cancel me", **LONG)  # several seconds of work
    tab.open(f"#/jobs/{job['id']}")
    tab.page.wait_for_selector("#job-status .status.running")
    tab.page.wait_for_function(
        "() => document.querySelector('#job-outputs pre.output')?.textContent.length > 0")
    tab.page.click("#job-cancel")
    tab.page.wait_for_selector("#job-status .status.cancelled")
    _wait_stream_complete(tab)
    row = wait_terminal(session_factory, job["id"])
    assert row.status == JobStatus.CANCELLED.value and row.finish_reason == "cancelled"
    assert row.completion_tokens is not None and row.completion_tokens < LONG["max_tokens"]
    assert tab.page.locator("#job-cancel").is_disabled()
    tab.assert_no_errors()


def test_form_submits_and_streams(tab, worker, session_factory):
    tab.open("#/submit")
    form = tab.page.locator("#submit-form")
    form.locator("textarea[name=prompt]").fill("a form prompt")
    form.locator("input[name=max_tokens]").fill("12")
    form.locator("input[name=temperature]").fill("0")
    tab.screenshot("dashboard-submit")
    form.locator("button[type=submit]").click()
    tab.page.wait_for_url(re.compile(r".*#/jobs/[0-9a-f-]{36}$"))
    job_id = tab.page.url.rsplit("/", 1)[-1]
    text = _wait_stream_complete(tab)
    row = read_job(session_factory, job_id)
    assert row.prompt == "a form prompt" and row.kind == "completion"
    assert row.params["max_tokens"] == 12 and row.params["temperature"] == 0.0
    assert text == row.output_text

    # chat messages through the same form
    tab.open("#/submit")
    form.locator("input[value=chat]").check()
    form.locator("textarea[name=system]").fill("be brief")
    form.locator("textarea[name=user]").fill("name a colour")
    form.locator("input[name=max_tokens]").fill("6")
    form.locator("button[type=submit]").click()
    tab.page.wait_for_url(re.compile(r".*#/jobs/[0-9a-f-]{36}$"))
    _wait_stream_complete(tab)
    row = read_job(session_factory, tab.page.url.rsplit("/", 1)[-1])
    assert row.kind == "chat" and row.messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]

    # a request the model cannot take is answered on the form, nothing is stored
    tab.open("#/submit")
    form.locator("input[name=max_tokens]").fill("1000000")
    form.locator("button[type=submit]").click()
    tab.page.wait_for_selector("#submit-error:not([hidden])")
    assert "max_tokens" in tab.page.locator("#submit-error").text_content()
    tab.assert_no_errors(allowed=r"status of 400")


def test_groups_panel_shows_the_worker(tab, worker):
    tab.open()
    group = tab.page.locator(f'#groups-body tr[data-group="{worker.group_id}"]')
    group.wait_for()
    tab.page.wait_for_function(
        "id => document.querySelector(`#groups-body tr[data-group='${id}'] .health`)"
        "?.textContent === 'healthy'", arg=worker.group_id)
    cells = group.locator("td").all_text_contents()
    assert cells[1] == "tiny" and cells[2] == "cpu" and cells[3] == "1"
    queue = tab.page.locator('#queues-body tr[data-model="tiny"] td').all_text_contents()
    assert queue[0] == "tiny" and int(queue[4]) >= 1
    # work shows in the rates: tokens/s above zero while jobs run, then a TTFT figure
    for i in range(6):
        submit(tab.base_url, prompt=f"rate {i}", max_tokens=120, ignore_eos=True)
    tab.page.wait_for_function(
        "() => Number(document.querySelector('[data-rate=tokens]').textContent) > 0")
    tab.page.wait_for_function(
        "() => Number(document.querySelector('[data-rate=ttft]').textContent) > 0")
    # the latency charts draw a line once samples hold a value (a few polls)
    tab.page.wait_for_function(
        "() => (document.querySelector('svg[data-chart=ttft] path.line')?.getAttribute('d')"
        " ?? '').split('L').length > 4")
    tab.screenshot("dashboard-overview")
    tab.assert_no_errors()


def test_stream_resumes_after_a_drop(browser, base_url, worker, session_factory):
    proxy = DroppingProxy(base_url)
    tab = Tab(browser, proxy.url)
    try:
        job = submit(base_url, prompt="drop me", max_tokens=STREAMED_TOKENS, ignore_eos=True,
                     temperature=0.0)
        events_requests: list[dict[str, str]] = []
        tab.page.on("request", lambda r: "/events" in r.url
                    and events_requests.append(r.headers))
        tab.open(f"#/jobs/{job['id']}")
        tab.page.wait_for_function(
            "() => document.querySelector('#job-outputs pre.output')?.textContent.length > 0")
        assert read_job(session_factory, job["id"]).status == JobStatus.RUNNING.value
        proxy.drop()  # mid-stream: the page reconnects by itself
        text = _wait_stream_complete(tab)
        assert len(events_requests) >= 2 and "last-event-id" not in events_requests[0]
        assert all(h.get("last-event-id") for h in events_requests[1:])
        # resumed exactly after the last event: nothing lost, nothing twice
        assert text == get_job(base_url, job["id"])["text"]
        assert read_job(session_factory, job["id"]).completion_tokens == STREAMED_TOKENS
        # a poll cut by the drop may log its network error; no script error may occur
        tab.assert_no_errors(allowed=r"net::ERR_")
    finally:
        tab.close()
        proxy.close()


def test_auth_mode_shows_only_the_keys_jobs(browser, start_web, service_settings,
                                            session_factory, worker):
    base = start_web(service_settings.with_overrides(auth_enabled=True))
    _, key_a = create_api_key(session_factory, "dash-alice")
    _, key_b = create_api_key(session_factory, "dash-bob")
    jobs_a = [_submit_as(base, key_a, f"alice {i}") for i in range(2)]
    job_b = _submit_as(base, key_b, "bob's job")
    tab = Tab(browser, base)
    try:
        tab.open()
        tab.page.wait_for_selector("#auth-view:not([hidden])")
        assert tab.page.locator("#overview-view").is_hidden()
        tab.screenshot("dashboard-auth")
        tab.page.fill("#auth-key", key_a)
        tab.page.click("#auth-form button[type=submit]")
        for job_id in jobs_a:
            _row(tab, job_id).wait_for()
        assert _row(tab, job_b).count() == 0
        assert tab.page.evaluate("sessionStorage.getItem('llmq.apiKey')") == key_a
        assert set(tab.page.locator("#jobs-body td:nth-child(6)").all_text_contents()) \
            == {"dash-alice"}
        tab.page.wait_for_function(
            "() => [...document.querySelectorAll('#status-counts b')]"
            ".reduce((n, b) => n + Number(b.textContent), 0) === 2")
        # a reload keeps the key (the tab's sessionStorage) and the same scope
        tab.page.reload()
        _row(tab, jobs_a[0]).wait_for()
        assert _row(tab, job_b).count() == 0
        # another key's job does not exist for this key
        tab.open(f"#/jobs/{job_b}")
        tab.page.wait_for_selector("#job-error:not([hidden])")
        assert "No job" in tab.page.locator("#job-error").text_content()
        assert tab.page.locator("#job-outputs pre.output").count() <= 1
        assert "bob" not in (tab.page.locator("#job-request").text_content() or "")
        # the raw JSON link carries the key through fetch
        tab.open(f"#/jobs/{jobs_a[0]}")
        tab.page.wait_for_selector("#job-status .status")
        tab.page.click("#job-raw")
        tab.page.wait_for_selector("#job-raw-json:not([hidden])")
        assert jobs_a[0] in tab.page.locator("#job-raw-json").text_content()
        tab.assert_no_errors(allowed=r"status of 404")
        # forgetting the key asks for one again
        tab.page.click("#sign-out")
        tab.page.wait_for_selector("#auth-view:not([hidden])")
        assert tab.page.evaluate("sessionStorage.getItem('llmq.apiKey')") is None
    finally:
        tab.close()
    for job_id in [*jobs_a, job_b]:
        wait_terminal(session_factory, job_id)


def _submit_as(base_url: str, key: str, prompt: str) -> str:
    response = requests.post(f"{base_url}/v1/jobs", json={"model": "tiny", "prompt": prompt,
                                                          "max_tokens": 4},
                             headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]

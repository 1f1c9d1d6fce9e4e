"""`llmq bench`: against a stub HTTP server with scripted timings (each backend), and
once against the real stack (web app over HTTP + a worker process)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from llmq.bench.arrivals import arrival_offsets
from llmq.bench.datasets import sample_prefix_repetition, sample_random
from llmq.bench.main import run_benchmark
from llmq.bench.prompts import WordVocabulary
from llmq.bench.sse import SseParser
from llmq.cli import build_bench_parser

BACKENDS = ["openai", "openai-chat", "llmq-jobs"]
FIRST_DELAY = 0.100  # s, request -> first chunk
ITL = 0.020  # s between chunks
# every key of vLLM's result JSON that `llmq bench` promises (default percentiles: p99)
VLLM_KEYS = {"date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed",
             "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput",
             "max_output_tokens_per_s", "max_concurrent_requests"} | {
    f"{stat}_{metric}_ms" for stat in ("mean", "median", "std", "p99")
    for metric in ("ttft", "tpot", "itl", "e2el")}
DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"}


class Stub:
    """Scripted server state: timings, failures, and what it saw (arrivals, concurrency).

    Prompt tokens are the prompt's words; one chunk (one token) every ITL after the first.
    Requests with max_tokens == 1 are the benchmark's probes: never failed nor recorded.
    """

    def __init__(self, fail_every: int = 0, slow_every: int = 0, slow_delay: float = 0.3):
        self.fail_every, self.slow_every, self.slow_delay = fail_every, slow_every, slow_delay
        self.lock = threading.Lock()
        self.count = 0
        self.active = 0
        self.peak = 0
        self.arrivals: list[float] = []
        self.prompt_tokens: list[int] = []
        self.jobs: dict[str, dict[str, Any]] = {}

    def admit(self, body: dict[str, Any]) -> tuple[bool, float]:
        """(fail?, first-chunk delay) of a new request."""
        if body.get("max_tokens", body.get("max_completion_tokens")) == 1:
            return False, 0.0
        with self.lock:
            self.count += 1
            self.arrivals.append(time.perf_counter())
            n = self.count
        fail = bool(self.fail_every) and n % self.fail_every == 0
        slow = bool(self.slow_every) and n % self.slow_every == 0
        return fail, self.slow_delay if slow else FIRST_DELAY

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def leave(self) -> None:
        with self.lock:
            self.active -= 1


def _prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return len(body["messages"][0]["content"].split()) + 5  # a "chat template"
    return len(body["prompt"].split())


def make_handler(stub: Stub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # a close-delimited stream: read as it arrives

        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _sse_start(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

        def _send(self, text: str) -> None:
            self.wfile.write(text.encode())
            self.wfile.flush()

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "stub-model"}]})
                return
            job_id = self.path.split("/")[3]
            job = stub.jobs[job_id]
            self._sse_start()
            self._send("retry: 2000\n\n: ping\n\n")
            started = job["posted_at"]
            for k in range(job["max_tokens"]):
                _sleep_until(started + job["delay"] + k * ITL)
                data = {"index": 0, "text": f"t{k} ", "token_ids": [k]}
                self._send(f"id: 1-{k}\nevent: token\ndata: {json.dumps(data)}\n\n")
            usage = {"prompt_tokens": job["prompt_tokens"],
                     "completion_tokens": job["max_tokens"]}
            # NOTE: leave before the last write: the client may start its next request as
            # soon as it reads it, before this thread runs again
            if job["counted"]:
                stub.leave()
            self._send(f"id: 1-x\nevent: done\ndata: {json.dumps({'usage': usage})}\n\n")

        def do_POST(self) -> None:  # noqa: N802
            posted_at = time.perf_counter()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            fail, delay = stub.admit(body)
            counted = body.get("max_tokens", body.get("max_completion_tokens")) != 1
            if fail:
                self._json(500, {"error": {"message": "scripted failure"}})
                return
            if counted:
                stub.enter()
                with stub.lock:
                    stub.prompt_tokens.append(_prompt_words(body))
            if self.path == "/v1/jobs":
                job_id = str(uuid.uuid4())
                stub.jobs[job_id] = {"posted_at": posted_at, "delay": delay,
                                     "max_tokens": body["max_tokens"],
                                     "prompt_tokens": _prompt_words(body), "counted": counted}
                self._json(202, {"id": job_id, "status": "queued"})
                return
            chat = self.path == "/v1/chat/completions"
            max_tokens = body["max_completion_tokens" if chat else "max_tokens"]
            self._sse_start()
            if chat:  # an opening role-only delta: must not count as the first token
                self._send("data: " + json.dumps({"choices": [{"index": 0, "delta": {
                    "role": "assistant"}}]}) + "\n\n")
            for k in range(max_tokens):
                _sleep_until(posted_at + delay + k * ITL)
                choice = ({"delta": {"content": f"t{k} "}} if chat else {"text": f"t{k} "})
                self._send("data: " + json.dumps({"choices": [{"index": 0, **choice}]}) + "\n\n")
            finish = {"delta": {}} if chat else {"text": ""}
            self._send("data: " + json.dumps({"choices": [{"index": 0, **finish,
                                                            "finish_reason": "length"}]}) + "\n\n")
            usage = {"prompt_tokens": _prompt_words(body), "completion_tokens": max_tokens}
            self._send("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n")
            if counted:  # before the last write, as above
                stub.leave()
            self._send("data: [DONE]\n\n")

    return Handler


def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


@pytest.fixture
def serve():
    servers = []

    def start(stub: Stub) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(stub))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def bench(base_url: str, *extra: str) -> dict[str, Any]:
    args = build_bench_parser().parse_args(["--base-url", base_url, "--disable-tqdm",
                                      "--random-input-len", "16", *extra])
    return run_benchmark(args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_metrics_match_the_scripted_timings(serve, backend, tmp_path):
    stub = Stub()
    url = serve(stub)
    result = bench(url, "--backend", backend, "--num-prompts", "6", "--random-output-len", "6",
                   "--max-concurrency", "3", "--save-result", "--save-detailed",
                   "--result-dir", str(tmp_path), "--percentile-metrics", "ttft,tpot,itl,e2el")
    assert VLLM_KEYS | DETAILED_KEYS <= set(result)
    assert result["backend"] == backend and result["model_id"] == "stub-model"
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["request_goodput"] is None  # no --goodput, as vLLM
    assert result["total_output_tokens"] == 36 and result["output_lens"] == [6] * 6
    # input tokens are the server's usage.prompt_tokens
    assert result["total_input_tokens"] == sum(stub.prompt_tokens)
    assert sorted(result["input_lens"]) == sorted(stub.prompt_tokens)
    # timings: TTFT 100 ms, a chunk every 20 ms, so TPOT 20 ms and E2EL 100 + 5 * 20 ms.
    # No request can beat the script; a loaded machine only delays one (the median holds)
    assert min(result["ttfts"]) >= 0.1
    assert result["median_ttft_ms"] == pytest.approx(100, abs=40)
    assert result["median_itl_ms"] == pytest.approx(20, abs=10)
    assert result["mean_tpot_ms"] == pytest.approx(20, abs=10)
    assert result["mean_e2el_ms"] == pytest.approx(200, abs=60)
    assert all(len(itl) == 5 for itl in result["itls"])
    assert result["generated_texts"][0] == "t0 t1 t2 t3 t4 t5 "
    assert 1 <= result["max_concurrent_requests"] <= 3 and stub.peak <= 3
    assert result["max_output_tokens_per_s"] > 0
    saved = list(tmp_path.glob(f"{backend}-infqps-concurrency3-stub-model-*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["completed"] == 6


def test_without_save_detailed_the_per_request_arrays_are_left_out(serve):
    result = bench(serve(Stub()), "--num-prompts", "2", "--random-output-len", "2")
    assert VLLM_KEYS <= set(result) and not DETAILED_KEYS & set(result)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failures_are_counted(serve, backend):
    stub = Stub(fail_every=3)
    result = bench(serve(stub), "--backend", backend, "--num-prompts", "6",
                   "--random-output-len", "3", "--max-concurrency", "1", "--save-detailed")
    assert result["completed"] == 4 and result["failed"] == 2
    errors = [e for e in result["errors"] if e]
    assert len(errors) == 2 and all("500" in e for e in errors)
    assert result["output_lens"].count(0) == 2 and result["total_output_tokens"] == 12


def test_goodput_counts_only_requests_within_the_slos(serve):
    stub = Stub(slow_every=2, slow_delay=0.4)  # every 2nd request: TTFT 400 ms
    result = bench(serve(stub), "--num-prompts", "6", "--random-output-len", "3",
                   "--max-concurrency", "2", "--goodput", "ttft:250", "tpot:100")
    good = result["request_goodput"] * result["duration"]
    assert good == pytest.approx(3, abs=1e-6)
    assert result["request_throughput"] * result["duration"] == pytest.approx(6, abs=1e-6)
    strict = bench(serve(Stub()), "--num-prompts", "4", "--random-output-len", "3",
                   "--goodput", "tpot:1")  # 20 ms per token: nothing is good
    assert strict["request_goodput"] == 0.0


def test_max_concurrency_is_never_exceeded(serve):
    stub = Stub()
    result = bench(serve(stub), "--backend", "openai", "--num-prompts", "10",
                   "--random-output-len", "4", "--max-concurrency", "2")
    assert result["completed"] == 10
    assert stub.peak == 2 and result["max_concurrent_requests"] <= 2
    assert result["max_concurrency"] == 2


def test_inter_arrival_times_are_poisson_or_gamma():
    rng = np.random.default_rng(0)
    for burstiness, cv in ((1.0, 1.0), (4.0, 0.5), (0.25, 2.0)):
        offsets = arrival_offsets(4000, 10.0, burstiness, rng)
        gaps = np.diff([0.0, *offsets])
        assert offsets[-1] == pytest.approx(400.0)  # rescaled: the last at n / rate
        assert gaps.mean() == pytest.approx(0.1, rel=1e-6)
        # gamma(k): coefficient of variation 1/sqrt(k); exponential (Poisson) has 1
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.12)
    assert arrival_offsets(5, float("inf"), 1.0, rng) == [0.0] * 5
    assert arrival_offsets(4, 2.0, float("inf"), rng) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    seeded = [arrival_offsets(50, 5.0, 1.0, np.random.default_rng(7)) for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_request_rate_paces_the_dispatch(serve):
    stub = Stub()
    result = bench(serve(stub), "--num-prompts", "20", "--random-output-len", "2",
                   "--request-rate", "20", "--seed", "3")
    assert result["completed"] == 20 and result["request_rate"] == 20.0
    gaps = np.diff(sorted(stub.arrivals))
    # 20 requests at 20/s: the last leaves 1 s after the start, gaps average ~50 ms
    assert sorted(stub.arrivals)[-1] - sorted(stub.arrivals)[0] == pytest.approx(1.0, abs=0.25)
    assert gaps.mean() == pytest.approx(0.05, abs=0.015)
    assert gaps.std() > 0.01  # Poisson gaps vary (a fixed pace would not)
    assert result["duration"] >= 1.0


def test_prefix_repetition_shares_each_prefix():
    vocab = WordVocabulary(1.0)
    rng = np.random.default_rng(0)
    samples = sample_prefix_repetition(vocab, rng, 13, prefix_len=20, suffix_len=10,
                                       num_prefixes=4, output_len=7)
    assert len(samples) == 13 and all(s.expected_output_len == 7 for s in samples)
    prefixes = {" ".join(s.prompt.split()[:20]) for s in samples}
    assert len(prefixes) == 4 and all(s.prompt_len == 30 for s in samples)
    random = sample_random(vocab, rng, 50, input_len=100, output_len=10, range_ratio=0.5,
                           prefix_len=5)
    assert {len(s.prompt.split()) for s in random} <= set(range(55, 156))
    assert {s.expected_output_len for s in random} <= set(range(5, 16))
    assert len({s.prompt.split()[0] for s in random}) == 1  # one shared random prefix


def test_calibration_scales_words_to_the_servers_tokens(serve):
    # the chat stub adds 5 template tokens to a prompt's words: 1 token per word remains
    result = bench(serve(Stub()), "--backend", "openai-chat", "--num-prompts", "3",
                   "--random-input-len", "40", "--random-output-len", "2", "--save-detailed")
    assert result["input_lens"] == [45, 45, 45]


def test_sse_parser_reassembles_split_events():
    parser = SseParser()
    assert parser.feed("retry: 2000\n\n: ping\n\nid: 1-0\nevent: tok") == []
    messages = parser.feed('en\r\ndata: {"a":\r\n\r\ndata: [DONE]\n\n')
    assert [(m.event, m.data, m.id) for m in messages] == [("token", '{"a":', "1-0"),
                                                           ("message", "[DONE]", None)]


def test_help_imports_no_server_code():
    code = ("import sys; from llmq.cli import main\n"
            "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'workers', 'webapp', 'kvcache', 'kernels', 'transformers')]\n"
            "print('BAD', bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "--max-concurrency" in out and "BAD []" in out


def test_bad_goodput_is_refused():
    with pytest.raises(ValueError, match="ttft, tpot, e2el"):
        bench("http://127.0.0.1:9", "--goodput", "latency:5", "--model", "m")


# --- the real stack ---------------------------------------------------------------------


@pytest.mark.integration
def test_llmq_bench_against_the_real_stack(start_web, service_settings, redis_client,
                                           tmp_path_factory, capsys):
    from tests.pipeline_helpers import running_worker

    with running_worker(service_settings, redis_client, tmp_path_factory.mktemp("workers"),
                        "bench", args=["--max-num-seqs", "8", "--kv-cache-bytes",
                                       str(16 * 1024 * 1024)]):
        base_url = start_web(service_settings)
        for backend in BACKENDS:
            result = bench(base_url, "--backend", backend, "--num-prompts", "4",
                           "--random-input-len", "24", "--random-output-len", "6",
                           "--max-concurrency", "2", "--save-detailed")
            assert result["completed"] == 4, result["errors"]
            assert result["failed"] == 0 and result["model_id"] == "tiny"
            assert result["output_lens"] == [6] * 4  # random: ignore_eos, as vLLM
            assert all(n > 0 for n in result["input_lens"])
            assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert "============ Serving Benchmark Result ============" in capsys.readouterr().out

"""`llmq bench`: run the benchmark the flags describe, print vLLM's table, save its JSON."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import replace
from datetime import datetime
from typing import Any

logger = logging.getLogger(__name__)


def cmd_bench(args: argparse.Namespace) -> int:
    result = run_benchmark(args)
    return 0 if result["completed"] else 1


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; return vLLM's result JSON (also written with --save-result)."""
    import numpy as np
    import requests

    from llmq.bench.args import parse_goodput
    from llmq.bench.arrivals import arrival_offsets
    from llmq.bench.backends import DEFAULT_ENDPOINTS, REQUEST_FUNCS
    from llmq.bench.datasets import get_samples
    from llmq.bench.metrics import calculate_metrics
    from llmq.bench.prompts import PromptVocabulary, TokenizerVocabulary, calibrate_words
    from llmq.bench.report import DETAILED_FIELDS, print_table, result_dict
    from llmq.bench.request_types import RequestInput
    from llmq.bench.runner import run_requests

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_url = base_url + (args.endpoint or DEFAULT_ENDPOINTS[args.backend])
    goodput = parse_goodput(args.goodput)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        for name in ("random_output_len", "sharegpt_output_len", "custom_output_len",
                     "prefix_repetition_output_len"):
            setattr(args, name, args.output_len)
    if args.dataset_name == "random":
        args.ignore_eos = True  # as vLLM: random prompts run to the requested length
    try:
        model_id = args.model or _first_model(base_url, args.api_key)
    except requests.ConnectionError:
        raise ValueError(f"cannot reach the server at {base_url} (start it with `llmq up`, "
                         "or pass --base-url)") from None
    extra_body = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k",
                                                         "min_p")
                  if getattr(args, name) is not None}
    request_func = REQUEST_FUNCS[args.backend]
    template = RequestInput(prompt="", api_url=api_url, prompt_len=0, output_len=1,
                            model=model_id, ignore_eos=args.ignore_eos, api_key=args.api_key,
                            extra_body=extra_body)

    vocab: PromptVocabulary
    if args.tokenizer:
        vocab = TokenizerVocabulary.load(args.tokenizer)
    else:
        print("No --tokenizer: measuring the server's tokens per word with two probe "
              "requests...")
        vocab = calibrate_words(lambda prompt: request_func(
            replace(template, prompt=prompt, output_len=1)))
    samples = get_samples(args, vocab)
    inputs = [replace(template, prompt=s.prompt, prompt_len=s.prompt_len,
                      output_len=s.expected_output_len) for s in samples]

    if args.num_warmups > 0 and inputs:
        print(f"Warming up with {args.num_warmups} requests...")
        run_requests(request_func, [inputs[0]] * args.num_warmups,
                     [0.0] * args.num_warmups, args.max_concurrency)
        print("Warmup run completed.")
    print("Starting main benchmark run...")
    distribution = "Poisson process" if args.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    offsets = arrival_offsets(len(inputs), args.request_rate, args.burstiness,
                              np.random.default_rng([args.seed, 1]))
    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(inputs))
    try:
        outputs, duration = run_requests(request_func, inputs, offsets, args.max_concurrency,
                                         on_done=None if pbar is None else lambda: pbar.update(1))
    finally:
        if pbar is not None:
            pbar.close()

    failed = [o for o in outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, output in enumerate(failed[:10]):
            print(f"Error {i}: {output.error}")
    metrics, output_lens = calculate_metrics(outputs, duration, percentiles, goodput)
    print_table(metrics, duration, args.max_concurrency, args.request_rate, goodput, shown)

    current_dt = datetime.now().strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "date": current_dt,
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": args.tokenizer,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **result_dict(metrics, outputs, output_lens, duration, goodput),
    }
    if not args.save_detailed:
        for name in DETAILED_FIELDS:
            result.pop(name, None)
    if args.save_result:
        path = result_path(args, model_id, current_dt)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f)
        print(f"Results saved to {path}")
    return result


def result_path(args: argparse.Namespace, model_id: str, current_dt: str) -> str:
    """vLLM's file name: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    concurrency = (f"-concurrency{args.max_concurrency}"
                   if args.max_concurrency is not None else "")
    name = args.result_filename or (f"{args.label or args.backend}-{args.request_rate}qps"
                                    f"{concurrency}-{model_id.split('/')[-1]}-{current_dt}.json")
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def _first_model(base_url: str, api_key: str | None) -> str:
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = requests.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    if response.status_code != 200:
        raise ValueError(f"GET {base_url}/v1/models answered {response.status_code}: "
                         f"{response.text[:200]} (pass --model)")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"the server at {base_url} serves no models")
    return str(models[0]["id"])

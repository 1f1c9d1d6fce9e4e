"""Structured-output benchmark: the decode step's cost of grammar bitmasks, and the
compile time of a 20-field JSON schema.

Decode step time at batch 32 on the `100m` preset (a random checkpoint made with
`workers.engine.make_model`), with none of the sequences constrained and with half of
them constrained by a 20-field JSON schema (bitmask fill on the engine side, bitmask
applied in the sampler, matchers advanced after the step). Every step timed is a decode
step of all 32 sequences. The two kinds of round alternate (free, constrained, free, ...)
so a load change on a shared machine hits both; the overhead reported is the median of
the per-pair ratios (constrained round / the free round before it), beside the ratio of
the medians. The CPU model, its vector flags and torch's thread count are printed too.

    python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --model-dir /tmp/m100 --steps 20 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tasks.params import SamplingParams  # noqa: E402
from tasks.structured import StructuredOutputs  # noqa: E402
from workers.engine.builder import build_engine  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402

BATCH = 32
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16",
                "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile", "neon", "asimd", "sve")


def cpu_info() -> dict:
    """The CPU model, its vector flags (of VECTOR_FLAGS) and torch's threads."""
    import torch

    model, flags, num_cpus = "unknown", set(), 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and model == "unknown":
                model = value.strip()
            elif key in ("flags", "Features"):
                flags.update(value.split())
            elif key == "processor":
                num_cpus += 1
    except OSError:
        pass
    return {"cpu": model, "num_cpus": num_cpus,
            "vector_flags": [f for f in VECTOR_FLAGS if f in flags],
            "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def schema_20_fields() -> dict:
    kinds = [{"type": "string", "maxLength": 24}, {"type": "integer", "minimum": 0},
             {"type": "number"}, {"type": "boolean"},
             {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
              "maxItems": 4}]
    props = {f"field_{i}": kinds[i % 5] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def decode_step_ms(engine, constrained: bool, steps: int, round_index: int) -> float:
    spec = StructuredOutputs(json=schema_20_fields())
    for i in range(BATCH):
        params = SamplingParams(max_tokens=steps + 8, temperature=1.0, ignore_eos=True,
                                seed=1000 * round_index + i,
                                structured_outputs=spec if constrained and i % 2 else None)
        engine.add_request(f"r{round_index}-{i}", [5 + i, 17, 42, 99, 7, 300, 11, 23], params)
    while engine.num_running < BATCH or any(s.num_computed_tokens < s.num_tokens - 1
                                            for s in engine.scheduler.running):
        engine.step()  # compiles (first round) and prefills, untimed
    times = []
    for _ in range(steps):
        if engine.num_running < BATCH:
            break  # a constrained sequence completed its JSON: the batch shrank
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(engine._requests):
        engine.abort_request(request_id)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="a 100m checkpoint (made if absent)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5, help="pairs of rounds")
    args = parser.parse_args()
    model_dir = args.model_dir
    if model_dir is None or not Path(model_dir).exists():
        from workers.engine.make_model import make_model

        model_dir = str(make_model(Path(model_dir or tempfile.mkdtemp()), preset="100m",
                                   arch="qwen3", seed=0))
    engine = build_engine(model_dir, config=EngineConfig(max_num_seqs=BATCH))

    backend = engine.structured.backend
    spec = StructuredOutputs(json=schema_20_fields())
    start = time.perf_counter()
    backend._get_compiler()
    tokenizer_s = time.perf_counter() - start
    compile_s = []
    for _ in range(3):
        start = time.perf_counter()
        backend.compile(spec)
        compile_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    backend.check(spec)
    check_s = time.perf_counter() - start

    free, constrained = [], []
    for r in range(args.rounds):
        free.append(decode_step_ms(engine, False, args.steps, 2 * r))
        constrained.append(decode_step_ms(engine, True, args.steps, 2 * r + 1))
    free_ms, constrained_ms = statistics.median(free), statistics.median(constrained)
    ratios = [c / f for f, c in zip(free, constrained)]
    print(json.dumps({
        **cpu_info(),
        "vocab": backend.vocab_size,
        "tokenizer_info_ms": round(tokenizer_s * 1e3, 1),
        "schema_20_fields_compile_ms": [round(s * 1e3, 1) for s in compile_s],
        "schema_20_fields_check_ms": round(check_s * 1e3, 2),
        "decode_step_ms_free": [round(x, 1) for x in free],
        "decode_step_ms_half_constrained": [round(x, 1) for x in constrained],
        "pair_ratios": [round(r, 3) for r in ratios],
        "overhead_percent_median_ratio": round(100 * (statistics.median(ratios) - 1), 1),
        "overhead_percent_of_medians": round(100 * (constrained_ms / free_ms - 1), 1),
    }, indent=1))
    engine.close()


if __name__ == "__main__":
    main()

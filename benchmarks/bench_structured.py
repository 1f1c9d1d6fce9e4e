"""Structured-output benchmark: the decode step's cost of grammar bitmasks, and the
compile time of a 20-field JSON schema.

Decode step time at batch 32 on the `100m` preset (a random checkpoint made with
`workers.engine.make_model`), with none of the sequences constrained and with half of
them constrained by a 20-field JSON schema (bitmask fill on the engine side, bitmask
applied in the sampler, matchers advanced after the step). Every step timed is a decode
step of all 32 sequences; the median of alternating rounds is reported.

    python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --model-dir /tmp/m100 --steps 20 --rounds 3
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
    parser.add_argument("--rounds", type=int, default=3)
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
    print(json.dumps({
        "vocab": backend.vocab_size,
        "tokenizer_info_ms": round(tokenizer_s * 1e3, 1),
        "schema_20_fields_compile_ms": [round(s * 1e3, 1) for s in compile_s],
        "schema_20_fields_check_ms": round(check_s * 1e3, 2),
        "decode_step_ms_free": [round(x, 1) for x in free],
        "decode_step_ms_half_constrained": [round(x, 1) for x in constrained],
        "overhead_percent": round(100 * (constrained_ms / free_ms - 1), 1),
    }, indent=1))
    engine.close()


if __name__ == "__main__":
    main()

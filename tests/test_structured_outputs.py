"""Structured outputs on random checkpoints: only the constraint makes a random model's
output valid, so every output is checked (jsonschema, re.fullmatch, membership) for
several seeds and sampling settings; free requests batched with constrained ones get
exactly their solo tokens; preemption and a failed step keep the matchers right."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

import kernels
from tasks.params import SamplingParams
from tasks.structured import InvalidStructuredOutputsError, StructuredOutputs
from tests.test_engine import assert_engine_empty, make_engine, run_all
from tests.test_step_isolation import FaultyRunner
from workers.engine.outputs import FinishReason

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "member": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                 "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 5},
                                   "zip": {"type": "integer", "minimum": 0,
                                           "maximum": 99999}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "member", "color", "address"],
}
REGEX = r"[a-z]{2,6}-\d{3}(\.[A-Z]{1,3})?"
CHOICES = ["yes", "no", "maybe so", "ja \"quoted\""]
PROMPT = [5, 17, 42, 99, 7, 300]


def _params(spec: StructuredOutputs, seed: int, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 1.0)
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 160), seed=seed,
                          structured_outputs=spec, **kwargs)


# ---- the contract ---------------------------------------------------------------------


def test_exactly_one_constraint_and_a_canonical_key() -> None:
    with pytest.raises(InvalidStructuredOutputsError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidStructuredOutputsError, match="exactly one.*json, regex"):
        StructuredOutputs(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidStructuredOutputsError, match="not valid JSON"):
        StructuredOutputs(json="{not json")
    with pytest.raises(InvalidStructuredOutputsError, match="choice"):
        StructuredOutputs(choice=[])
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {}, "b": {}}})
    b = StructuredOutputs(json='{"properties": {"b": {}, "a": {}}, "type": "object"}')
    assert a.key() == b.key()
    assert a.key() != StructuredOutputs(json_object=True).key()
    params = SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]
    assert params.structured_outputs == StructuredOutputs(regex="a+")
    with pytest.raises(InvalidStructuredOutputsError, match="unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a+"})  # type: ignore[arg-type]


def test_apply_token_bitmask_masks_exactly_the_disallowed_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(4, vocab, generator=gen)
    allowed = torch.rand(2, vocab, generator=gen) < 0.3
    words = np.zeros((2, 3), dtype=np.int64)
    for r in range(2):
        for t in range(vocab):
            if allowed[r, t]:
                words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    out = kernels.apply_token_bitmask(logits.clone(), bitmask, [3, 1])
    expected = logits.clone()
    expected[3][~allowed[0]] = float("-inf")
    expected[1][~allowed[1]] = float("-inf")
    assert torch.equal(out, expected)


# ---- on a random checkpoint ---------------------------------------------------------


def test_json_schema_outputs_validate_for_every_seed(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir)
    spec = StructuredOutputs(json=SCHEMA)
    settings = [{}, {"top_k": 20}, {"top_p": 0.8}, {"min_p": 0.05}, {"temperature": 0.0}]
    arrivals = {0: [(f"s{seed}", PROMPT, _params(spec, seed, **settings[seed % 5]))
                    for seed in range(10)]}
    _, texts, finals = run_all(engine, arrivals)
    for request_id, final in finals.items():
        assert final[0].finish_reason == FinishReason.STOP, (request_id, texts[request_id])
        jsonschema.validate(json.loads(texts[request_id][0]), SCHEMA)
    assert engine.structured.num_compiles == 1  # one compile, nine cache hits
    assert_engine_empty(engine)


def test_regex_choice_grammar_and_json_object(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    ebnf = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    specs = {"regex": StructuredOutputs(regex=REGEX),
             "choice": StructuredOutputs(choice=CHOICES),
             "grammar": StructuredOutputs(grammar=ebnf),
             "object": StructuredOutputs(json_object=True)}
    arrivals = {0: [(f"{kind}{seed}", PROMPT, _params(spec, seed, max_tokens=60,
                                                       logprobs=2))
                    for kind, spec in specs.items() if kind != "object"
                    for seed in range(6)]}
    # json_object: a random model may nest forever; a small max_tokens still must stop or
    # be a valid prefix, so only count the ones that stopped
    arrivals[1] = [(f"object{seed}", PROMPT, _params(specs["object"], seed, max_tokens=80))
                   for seed in range(4)]
    _, texts, finals = run_all(engine, arrivals)
    for request_id, final in finals.items():
        text = texts[request_id][0]
        if request_id.startswith("object"):
            if final[0].finish_reason == FinishReason.STOP:
                assert isinstance(json.loads(text), dict)
            continue
        assert final[0].finish_reason == FinishReason.STOP, (request_id, text)
        if request_id.startswith("regex"):
            assert re.fullmatch(REGEX, text), text
        elif request_id.startswith("choice"):
            assert text in CHOICES
        else:
            assert re.fullmatch(r"\(\d{1,2}( \+ \d{1,2})*\)", text), text
    assert_engine_empty(engine)


def test_free_requests_in_a_constrained_batch_get_their_solo_tokens(
    tiny_qwen2_dir: Path,
) -> None:
    free = [(f"free{i}", [3 + i, 50, 60 + i, 7],
             SamplingParams(max_tokens=20, temperature=[0.0, 1.0][i % 2], seed=i, top_k=5 * i,
                            ignore_eos=True))
            for i in range(4)]
    solo = {}
    for request_id, prompt, params in free:
        tokens, _, _ = run_all(make_engine(tiny_qwen2_dir), {0: [(request_id, prompt, params)]})
        solo[request_id] = tokens[request_id][0]
    constrained = [(f"json{i}", PROMPT, _params(StructuredOutputs(json=SCHEMA), 100 + i))
                   for i in range(4)]
    engine = make_engine(tiny_qwen2_dir)
    tokens, texts, _ = run_all(engine, {0: constrained[:2] + free[:2],
                                        2: free[2:] + constrained[2:]})
    for request_id, _, _ in free:
        assert tokens[request_id][0] == solo[request_id]
    for request_id, _, _ in constrained:
        jsonschema.validate(json.loads(texts[request_id][0]), SCHEMA)


def test_preempted_constrained_requests_still_validate(tiny_qwen3_dir: Path) -> None:
    # 12 blocks of 16 tokens for 8 sequences growing to ~100 tokens: forces preemption
    engine = make_engine(tiny_qwen3_dir, num_blocks=12, max_num_seqs=8)
    arrivals = {0: [(f"j{seed}", PROMPT * 3, _params(StructuredOutputs(json=SCHEMA), seed))
                    for seed in range(8)]}
    _, texts, finals = run_all(engine, arrivals)
    assert engine.stats().num_preemptions > 0
    for request_id in finals:
        jsonschema.validate(json.loads(texts[request_id][0]), SCHEMA)
    assert_engine_empty(engine)


def test_invalid_constraint_fails_only_its_request(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir)
    engine.add_request("ok", PROMPT, _params(StructuredOutputs(regex=REGEX), 1))
    # caught without the backend (tasks/structured_check.py), as the web does
    with pytest.raises(ValueError, match=r"structured_outputs.regex is not a valid regular"):
        engine.add_request("bad", PROMPT, _params(StructuredOutputs(regex="[a-z"), 2))
    with pytest.raises(ValueError, match=r"structured_outputs.json: 'type' at # must be"):
        engine.add_request("bad2", PROMPT,
                           _params(StructuredOutputs(json={"type": "frobnicate"}), 3))
    # caught by the backend's parse in add_request
    with pytest.raises(ValueError, match=r"structured_outputs.grammar .*not defined"):
        engine.add_request("bad3", PROMPT,
                           _params(StructuredOutputs(grammar="root ::= undefined_rule"), 4))
    texts = {"ok": ""}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            texts[delta.request_id] += delta.text
    assert re.fullmatch(REGEX, texts["ok"])
    assert_engine_empty(engine)


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(
    tiny_qwen3_dir: Path,
) -> None:
    engine = make_engine(tiny_qwen3_dir)
    backend = engine.structured.backend
    compile_ok = backend.compile

    def compile_or_fail(spec: StructuredOutputs):
        if spec.regex == "x+":
            raise InvalidStructuredOutputsError("structured_outputs.regex is not usable: boom")
        return compile_ok(spec)

    backend.compile = compile_or_fail  # type: ignore[method-assign]
    engine.add_request("bad", PROMPT, _params(StructuredOutputs(regex="x+"), 1))
    engine.add_request("ok", PROMPT, _params(StructuredOutputs(choice=CHOICES), 2))
    engine.add_request("free", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    finals = {}
    texts = {"ok": "", "free": "", "bad": ""}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            texts[delta.request_id] += delta.text
            if delta.finished:
                finals[delta.request_id] = delta
    assert finals["bad"].finish_reason == FinishReason.ERROR
    assert "boom" in (finals["bad"].error or "")
    assert texts["ok"] in CHOICES and finals["free"].num_output_tokens == 5
    assert_engine_empty(engine)


def test_a_failed_step_does_not_move_the_matchers(tiny_qwen3_dir: Path) -> None:
    engine = make_engine(tiny_qwen3_dir)
    runner = FaultyRunner(engine)
    params = [_params(StructuredOutputs(json=SCHEMA), seed) for seed in range(3)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", PROMPT, p)
    texts = {f"r{i}": "" for i in range(3)}
    step = 0
    while engine.has_unfinished_requests():
        if step == 5:  # once: the isolation runs then all succeed
            runner.fail_next = True
        for delta in engine.step():
            texts[delta.request_id] += delta.text
        for seq in engine.scheduler.seqs.values():
            if seq.grammar is not None and seq.grammar.num_accepted:
                assert seq.grammar.num_accepted == seq.num_output_tokens
        step += 1
    assert runner.num_failures == 1
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_offline_llm_takes_structured_outputs(tiny_qwen3_dir: Path) -> None:
    from workers import LLM
    from workers import SamplingParams as Params
    from workers import StructuredOutputs as Outputs

    with LLM(str(tiny_qwen3_dir)) as llm:
        outputs = llm.generate(["Hello there", "The river"], [
            Params(max_tokens=40, seed=4, structured_outputs=Outputs(choice=CHOICES)),
            Params(max_tokens=40, seed=5, structured_outputs=Outputs(regex=REGEX)),
        ])
    assert outputs[0].outputs[0].text in CHOICES
    assert re.fullmatch(REGEX, outputs[1].outputs[0].text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_past_a_complete_grammar_ends_with_stop(
    tiny_qwen3_dir: Path, temperature: float
) -> None:
    """The grammar wins over min_tokens: once only an end token is allowed, the sequence
    finishes with `stop` and the text is exactly a string of the grammar (no hang, no
    error, nothing past it)."""
    engine = make_engine(tiny_qwen3_dir)
    engine.add_request("choice", PROMPT, _params(StructuredOutputs(choice=["ok"]), 1,
                                                 min_tokens=20, max_tokens=30,
                                                 temperature=temperature))
    engine.add_request("regex", PROMPT, _params(StructuredOutputs(regex="[ab]"), 2,
                                                min_tokens=20, max_tokens=30,
                                                temperature=temperature))
    texts = {"choice": "", "regex": ""}
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            texts[delta.request_id] += delta.text
            if delta.finished:
                finals[delta.request_id] = delta
    assert not engine.has_unfinished_requests()
    assert finals["choice"].finish_reason == FinishReason.STOP
    assert finals["regex"].finish_reason == FinishReason.STOP
    assert texts["choice"] == "ok"
    assert re.fullmatch("[ab]", texts["regex"])
    assert_engine_empty(engine)

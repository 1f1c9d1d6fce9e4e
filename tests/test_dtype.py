"""The dtype "auto" picks, and the bf16 path: our runner in bf16 agrees with Hugging Face
`transformers` in bf16 as closely as bf16 allows.

The rest of the suite runs in fp32 (tests/conftest.py pins LLMQ_DTYPE); here each test
names its dtype or clears the pin.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import describe, has_native_bf16
from tests.test_model_exactness import HandDriver, _prompts, _runner
from workers.engine.loader import DTYPE_ENV, CheckpointError, auto_dtype, load_checkpoint
from workers.engine.step_io import SchedulerOutput

NUM_NEW_TOKENS = 16


@pytest.mark.parametrize(("stored", "device", "env", "native", "expected"), [
    ("float32", "cpu", None, True, "bfloat16"),  # Zen 4, Sapphire Rapids
    ("bfloat16", "cpu", None, False, "float32"),  # emulated bf16 is slower than fp32
    ("float16", "cpu", None, False, "float32"),
    ("float32", "cpu", "auto", True, "bfloat16"),
    ("float32", "cpu", "float32", True, "float32"),  # LLMQ_DTYPE decides
    ("bfloat16", "cpu", "float16", False, "float16"),
    ("bfloat16", "cuda", None, True, "bfloat16"),  # an accelerator: the checkpoint's
    ("float16", "npu", None, False, "float16"),
])
def test_auto_dtype_rule(stored, device, env, native, expected):
    assert auto_dtype(stored, device, env, native_bf16=native) == expected


def test_auto_on_this_cpu_follows_its_bf16_support(tiny_qwen3_dir, monkeypatch):
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    expected = torch.bfloat16 if has_native_bf16() else torch.float32
    assert load_checkpoint(tiny_qwen3_dir).config.dtype == expected, describe()
    monkeypatch.setenv(DTYPE_ENV, "float32")
    assert load_checkpoint(tiny_qwen3_dir).config.dtype == torch.float32
    # an explicit dtype beats the variable
    assert load_checkpoint(tiny_qwen3_dir, dtype="bfloat16").config.dtype == torch.bfloat16
    monkeypatch.setenv(DTYPE_ENV, "float64")
    with pytest.raises(CheckpointError, match=f"'float64' is not supported.*{DTYPE_ENV}"):
        load_checkpoint(tiny_qwen3_dir)


@pytest.fixture(scope="module", params=["tiny_qwen3_dir", "tiny_llama_dir"])
def bf16_case(request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(request.param)
    loaded = load_checkpoint(model_dir, dtype="bfloat16")
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                dtype=torch.bfloat16).eval()
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                                dtype=torch.float32).eval()
    return loaded, hf16, hf32


def test_bf16_prompt_logits_within_bf16_rounding_of_hf(bf16_case):
    loaded, hf16, hf32 = bf16_case
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    prompt = _prompts(loaded.config.vocab_size)[-1]
    with torch.inference_mode():
        ref16 = hf16(torch.tensor([prompt])).logits[0].float()
        ref32 = hf32(torch.tensor([prompt])).logits[0].float()
    driver = HandDriver(_runner(loaded))
    seq = driver.add(prompt)
    ours = driver.runner.forward_logits(SchedulerOutput([driver._schedule(seq)], len(prompt)))
    # NOTE: bf16 keeps 8 bits of mantissa; what transformers' own bf16 run drifts from fp32
    # is the scale of a legitimate difference, and ours must stay within twice it
    hf_drift = (ref16 - ref32).abs().max().item()
    assert 0 < hf_drift < 0.5
    assert (ours - ref16).abs().max().item() <= 2 * hf_drift
    assert (ours - ref32).abs().max().item() <= 2 * hf_drift
    # the top token of almost every position agrees with transformers' bf16 run
    agree = (ours.argmax(-1) == ref16.argmax(-1)).float().mean().item()
    assert agree >= 0.95


def test_bf16_greedy_tokens_match_hf_bf16(bf16_case):
    loaded, hf16, _ = bf16_case
    runner = _runner(loaded)
    prompts = _prompts(loaded.config.vocab_size)[1:4]
    matched = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf16.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NUM_NEW_TOKENS, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        driver = HandDriver(runner, seed=len(prompt))
        seq = driver.add(prompt)
        while len(seq.output) < NUM_NEW_TOKENS:
            driver.step([seq])
        # NOTE: a near tie can flip under bf16 rounding and then the rest diverges: count
        # the common prefix, and demand most of it
        prefix = next((i for i, (a, b) in enumerate(zip(seq.output, ref)) if a != b),
                      NUM_NEW_TOKENS)
        matched += prefix
    assert matched >= 0.8 * NUM_NEW_TOKENS * len(prompts)

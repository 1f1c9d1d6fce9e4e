"""The sampler: greedy, seeded reproducibility, filters, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.params import SamplingParams
from workers.engine.sampler import (
    _uniform_for_step,
    apply_penalties,
    build_sampling_metadata,
    sample,
    sample_with_metadata,
)
from workers.engine.step_io import ScheduledSequence

VOCAB = 64


def make_seq(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seq_id: int = 0,
) -> ScheduledSequence:
    prompt = [1, 2, 3] if prompt is None else prompt
    output = [] if output is None else output
    return ScheduledSequence(
        seq_id=seq_id,
        token_ids=[(prompt + output)[-1]],
        start_pos=len(prompt) + len(output) - 1,
        block_table=[0],
        sample=True,
        params=params,
        prompt_token_ids=prompt,
        output_token_ids=output,
    )


def random_logits(num_rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=g) * 3


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = random_logits(8, 0)
    before = logits.clone()
    seqs = [make_seq(SamplingParams(temperature=0.0), seq_id=i) for i in range(8)]
    token_ids, logprobs = sample(logits, seqs)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows() -> None:
    logits = random_logits(4, 1)
    seqs = [
        make_seq(SamplingParams(temperature=0.0)),
        make_seq(SamplingParams(temperature=1.0, seed=3)),
        make_seq(SamplingParams(temperature=0.0)),
        make_seq(SamplingParams(temperature=0.7)),
    ]
    token_ids, _ = sample(logits, seqs)
    assert token_ids[0] == int(logits[0].argmax())
    assert token_ids[2] == int(logits[2].argmax())
    assert all(0 <= t < VOCAB for t in token_ids)


def run_steps(params: SamplingParams, companions: list[SamplingParams], position: int,
              num_steps: int) -> list[int]:
    """Sample `num_steps` tokens for one seeded sequence placed at `position` in a batch."""
    output: list[int] = []
    companion_outputs: list[list[int]] = [[] for _ in companions]
    for step in range(num_steps):
        # The target's logits depend only on the step, never on the batch.
        target_logits = random_logits(1, 1000 + step)
        rows = [random_logits(1, 5000 + 31 * step + j) for j in range(len(companions))]
        rows.insert(position, target_logits)
        seqs = [make_seq(p, output=o) for p, o in zip(companions, companion_outputs)]
        seqs.insert(position, make_seq(params, output=output))
        token_ids, _ = sample(torch.cat(rows), seqs)
        output.append(token_ids[position])
        for o, t in zip(companion_outputs, token_ids[:position] + token_ids[position + 1:]):
            o.append(t)
    return output


def test_seeded_sampling_reproducible_alone_and_in_batches() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=64)
    alone = run_steps(params, [], 0, 40)
    assert alone == run_steps(params, [], 0, 40)
    companions = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5, seed=99),
        SamplingParams(temperature=1.0, seed=1234, repetition_penalty=1.3),
    ]
    assert run_steps(params, companions, 0, 40) == alone
    assert run_steps(params, companions, 2, 40) == alone
    assert run_steps(params, companions[:2], 2, 40) == alone
    # With a top-k, wider companions (k=50) change the candidates the batch works on.
    params_k = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=77)
    alone_k = run_steps(params_k, [], 0, 30)
    wide = [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.0)]
    assert run_steps(params_k, wide, 1, 30) == alone_k
    # A different seed draws a different stream (40 draws from a flat-ish distribution).
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=1235, max_tokens=64)
    assert run_steps(other, [], 0, 40) != alone


def test_unseeded_sampling_follows_the_distribution() -> None:
    # Two tokens with probabilities 0.8 / 0.2: the frequency lands near 0.8.
    logits = torch.full((2000, VOCAB), -1e9)
    logits[:, 0] = math.log(0.8)
    logits[:, 1] = math.log(0.2)
    seqs = [make_seq(SamplingParams(temperature=1.0)) for _ in range(2000)]
    token_ids, _ = sample(logits, seqs)
    assert set(token_ids) <= {0, 1}
    assert 0.75 < token_ids.count(0) / 2000 < 0.85


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([64, 1000]),
    top_k=st.integers(0, 1002),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 1.0),
    temperature=st.floats(0.1, 3.0),
    scale=st.floats(0.1, 20.0),
)
def test_filters_never_sample_outside_their_set(
    seed: int, vocab: int, top_k: int, top_p: float, min_p: float, temperature: float,
    scale: float,
) -> None:
    # Peaked rows (large scale) keep the nucleus inside the first candidates; flat rows
    # (small scale, vocab 1000) reach past them and take the full-sort path.
    num_rows = 8
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    seqs = [make_seq(params) for _ in range(num_rows)]
    token_ids, _ = sample(logits, seqs)
    for row, token in zip(logits, token_ids):
        x = row / temperature
        value = x[token]
        probs = torch.softmax(x, dim=-1)
        assert probs[token] >= min_p * probs.max() - 1e-6
        if 0 < top_k < vocab:
            kth = x.topk(top_k).values[-1]
            assert value >= kth
            x = x.masked_fill(x < kth, float("-inf"))
        # Nucleus (after top-k): the mass of strictly better tokens stays below top_p.
        probs = torch.softmax(x, dim=-1)
        assert probs[x > value].sum() < top_p + 1e-5


def test_top_k_keeps_exactly_k() -> None:
    logits = torch.zeros(512, VOCAB)
    logits[:, :4] = torch.tensor([3.0, 2.9, 2.8, 2.7])  # near-equal: all four likely
    for top_p in (1.0, 0.999):  # the threshold path and the sorted-candidates path
        # Rows with a larger k in the same batch widen the candidates of the others.
        params = [SamplingParams(temperature=1.0, top_k=k, top_p=top_p) for k in (2, 3, 0)]
        seqs = [make_seq(params[i % 3]) for i in range(512)]
        token_ids, _ = sample(logits, seqs)
        assert set(token_ids[0::3]) == {0, 1}
        assert set(token_ids[1::3]) == {0, 1, 2}
        assert len(set(token_ids[2::3])) > 3


def test_top_k_one_and_min_p_one_are_greedy() -> None:
    logits = random_logits(32, 7)
    for params in (SamplingParams(top_k=1), SamplingParams(min_p=1.0), SamplingParams(top_p=1e-6)):
        token_ids, _ = sample(logits, [make_seq(params) for _ in range(32)])
        assert token_ids == logits.argmax(dim=-1).tolist()


def reference_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    """The penalties token by token, straight from their definitions."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        if out[token] > 0:
            out[token] = out[token] / params.repetition_penalty
        else:
            out[token] = out[token] * params.repetition_penalty
    for token in set(output):
        out[token] -= params.presence_penalty + params.frequency_penalty * output.count(token)
    return out


PENALTY_CASES = [
    (SamplingParams(temperature=0.0, repetition_penalty=1.7), [4, 5, 6, 4], [7, 8, 7]),
    (SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5),
     [9, 10], [11, 11, 11, 12]),
    (SamplingParams(temperature=0.0, repetition_penalty=0.6, presence_penalty=-1.0,
                    frequency_penalty=2.0), [1, 2, 3], [3, 3, 20, 40, 41]),
]


def test_penalties_match_reference() -> None:
    logits = random_logits(3, 11)
    seqs = [make_seq(p, prompt, output) for p, prompt, output in PENALTY_CASES]
    penalised = apply_penalties(logits, seqs)
    for i, case in enumerate(PENALTY_CASES):
        torch.testing.assert_close(penalised[i], reference_penalties(logits[i], *case))
    # Greedy sampling follows the penalised logits.
    token_ids, _ = sample(logits, seqs)
    assert token_ids == penalised.argmax(dim=-1).tolist()
    # Rows without penalties, mixed in, come through exactly as they were.
    seqs.insert(1, make_seq(SamplingParams(temperature=0.0), [4, 5], [6]))
    mixed = torch.cat([logits[:1], random_logits(1, 12), logits[1:]])
    penalised = apply_penalties(mixed, seqs)
    assert torch.equal(penalised[1], mixed[1])
    torch.testing.assert_close(penalised[3], reference_penalties(logits[2], *PENALTY_CASES[2]))


def test_penalties_can_change_the_greedy_token() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 2.0  # the best token, already generated twice
    logits[0, 8] = 1.5
    for params in (SamplingParams(temperature=0.0, repetition_penalty=1.5),
                   SamplingParams(temperature=0.0, frequency_penalty=0.3),
                   SamplingParams(temperature=0.0, presence_penalty=0.6)):
        token_ids, _ = sample(logits, [make_seq(params, output=[7, 7])])
        assert token_ids == [8], params
    token_ids, _ = sample(logits, [make_seq(SamplingParams(temperature=0.0), output=[7, 7])])
    assert token_ids == [7]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    eos, stop = 5, 9
    logits = torch.zeros(4, VOCAB)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    logits[:, 30] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    seqs = [
        make_seq(params, output=[1, 2]),  # one short: eos and stop masked
        make_seq(params, output=[1, 2, 3]),  # reached min_tokens: eos allowed
        make_seq(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop],
                                ignore_eos=True), output=[]),  # eos never stops it: not masked
        make_seq(SamplingParams(temperature=0.0), output=[]),
    ]
    token_ids, _ = sample(logits, seqs, eos_token_ids=[eos])
    assert token_ids == [30, eos, eos, eos]
    # Random rows obey the mask too.
    hot = make_seq(SamplingParams(temperature=2.0, min_tokens=2), output=[])
    token_ids, _ = sample(logits[:1].expand(64, -1).contiguous(), [hot] * 64, eos_token_ids=[eos])
    assert eos not in token_ids


def test_logprobs_shape_and_values() -> None:
    logits = random_logits(3, 21)
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logprobs=5)),
        make_seq(SamplingParams(temperature=0.0)),
        make_seq(SamplingParams(temperature=1.0, logprobs=0, repetition_penalty=2.0,
                                seed=4), output=[0, 1, 2]),
    ]
    token_ids, logprobs = sample(logits, seqs)
    reference = torch.log_softmax(logits, dim=-1)
    first = logprobs[0]
    assert first is not None and logprobs[1] is None
    assert first.token_id == token_ids[0]
    assert len(first.top) == 5
    assert first.top[0][0] == token_ids[0]
    assert first.top[0][1] == pytest.approx(float(reference[0].max()), abs=1e-6)
    assert first.logprob == pytest.approx(float(reference[0].max()), abs=1e-6)
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    third = logprobs[2]
    assert third is not None and third.top == []
    # Raw model logprobs: penalties and temperature do not change them.
    assert third.logprob == pytest.approx(float(reference[2, token_ids[2]]), abs=1e-6)


def best_time(fn, repeats: int = 15) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.alone
def test_python_overhead_of_a_batch_of_64_is_small() -> None:
    # A tiny vocabulary makes the tensor work negligible: what is left is the per-step
    # Python cost, which must not grow into the step time of a real model. One intra-op
    # thread, so waking a thread pool on a busy machine does not pass for Python time.
    logits = random_logits(64, 3)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_overhead(logits)
    finally:
        torch.set_num_threads(num_threads)


def check_overhead(logits: torch.Tensor) -> None:
    cases = {
        "greedy": (SamplingParams(temperature=0.0), 0.001),
        "same sampled params": (SamplingParams(temperature=0.8, top_p=0.9, top_k=40), 0.003),
        "seeded": (SamplingParams(temperature=0.8, seed=7), 0.003),
    }
    for name, (params, budget) in cases.items():
        seqs = [make_seq(params, output=[1, 2, 3]) for _ in range(64)]
        elapsed = best_time(lambda seqs=seqs: sample(logits, seqs))
        assert elapsed < budget, f"{name}: {elapsed * 1e3:.3f} ms per batch of 64"


def test_metadata_reads_each_row_once_into_kernel_inputs() -> None:
    vocab = 50
    seqs = [
        make_seq(SamplingParams(temperature=0.0, logprobs=3)),
        make_seq(SamplingParams(temperature=0.7, top_k=80, seed=5), output=[9, 9]),
        make_seq(SamplingParams(temperature=1.2, top_k=7, top_p=0.5, min_p=0.1)),
        make_seq(SamplingParams(temperature=0.9, repetition_penalty=1.5, min_tokens=2,
                                stop_token_ids=[11], logprobs=0), prompt=[4, 5], output=[6]),
        make_seq(SamplingParams(temperature=0.0, frequency_penalty=0.5, min_tokens=3,
                                stop_token_ids=[12], ignore_eos=True), output=[8, 8]),
    ]
    m = build_sampling_metadata(seqs, [2, 3], vocab, torch.device("cpu"))
    assert m.num_rows == 5
    assert m.random_rows == [1, 2, 3]
    assert m.temperatures is not None and m.temperatures.shape == (3, 1)
    assert m.temperatures.flatten().tolist() == pytest.approx([0.7, 1.2, 0.9])
    assert m.min_p is not None and m.min_p.flatten().tolist() == pytest.approx([0.0, 0.1, 0.0])
    # top_k=80 is past the vocabulary: no filter on row 1.
    assert (m.filtered, m.unfiltered) == ([1], [0, 2])
    assert m.top_k is not None and m.top_k.tolist() == [[7]]
    assert m.top_p is not None and m.top_p.tolist() == [[0.5]]
    assert m.num_candidates == 7
    assert m.uniforms is not None and m.uniforms.dtype == torch.float64
    assert float(m.uniforms[0]) == _uniform_for_step(5, 2)
    # Row 3 masks its stop id and both EOS ids; row 4 ignores EOS, so only its stop id.
    assert list(zip(m.masked_rows, m.masked_token_ids)) == [(3, 11), (3, 2), (3, 3), (4, 12)]
    assert (m.logprob_rows, m.num_logprobs) == ([0, 3], [3, 0])
    assert m.repetition_keys is not None and m.repetition_penalties is not None
    assert sorted(m.repetition_keys.tolist()) == [3 * vocab + t for t in (4, 5, 6)]
    assert m.repetition_penalties.tolist() == [1.0, 1.0, 1.0, 1.5, 1.0]
    assert m.count_keys is not None and m.presence_frequency is not None
    assert m.count_keys.tolist() == [4 * vocab + 8] * 2
    assert m.presence_frequency[4].tolist() == [0.0, 0.5]

    # Sampling from the metadata is `sample`: the same tokens and logprobs.
    logits = random_logits(5, 31, vocab)
    torch.manual_seed(0)
    expected = sample(logits, seqs, eos_token_ids=[2, 3])
    torch.manual_seed(0)
    m = build_sampling_metadata(seqs, [2, 3], vocab, logits.device)
    assert sample_with_metadata(logits, m) == expected


def test_metadata_of_an_all_greedy_batch_holds_no_tensors() -> None:
    seqs = [make_seq(SamplingParams(temperature=0.0)) for _ in range(4)]
    m = build_sampling_metadata(seqs, [2], VOCAB, torch.device("cpu"))
    assert m.random_rows == [] and m.temperatures is None and m.uniforms is None
    assert m.repetition_keys is None and m.count_keys is None and m.masked_rows == []
    # No random draw: torch's generator is left where it was.
    torch.manual_seed(1)
    build_sampling_metadata(seqs, [2], VOCAB, torch.device("cpu"))
    after = torch.rand(1)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(1))

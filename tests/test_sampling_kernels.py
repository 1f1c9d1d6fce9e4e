"""The sampling kernels (kernels/sampling.py) on tensors alone: penalties over flat keys,
masks, greedy, min-p, inverse-CDF draws, top-k / top-p, logprobs; their dispatch; and
the layering (the module imports nothing above kernels/)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import dispatch
from kernels.sampling import (
    NUCLEUS_CANDIDATES,
    apply_penalties,
    filter_min_p,
    gather_logprobs,
    greedy_sample,
    mask_tokens,
    num_nucleus_candidates,
    sample_by_cdf,
    top_k_top_p_sample,
)


def grid(num: int) -> torch.Tensor:
    """[num] float64 uniforms spread over [0, 1)."""
    return (torch.arange(num, dtype=torch.float64) + 0.5) / num


def test_sampling_kernels_import_nothing_above_kernels() -> None:
    code = (
        "import sys, kernels.sampling, kernels; kernels.dispatch.get('top_k_top_p_sample', 'cpu')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tasks', 'workers', 'kvcache', 'webapp', 'llmq'))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_apply_penalties_over_flat_keys_equals_dense() -> None:
    vocab = 10
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    before = logits.clone()
    # Row 0: repetition 2.0 over tokens {1, 4} (4 given twice: penalised once).
    # Row 2: repetition 0.5 over {0}; presence 0.5 + frequency 1.0 over outputs [3, 3, 7].
    repetition_keys = torch.tensor([0 * vocab + 1, 0 * vocab + 4, 0 * vocab + 4, 2 * vocab + 0])
    repetition = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    count_keys = torch.tensor([2 * vocab + 3, 2 * vocab + 7, 2 * vocab + 3])
    presence_frequency = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.5, 1.0]], dtype=torch.float64)
    out = apply_penalties(logits, repetition_keys, repetition, count_keys, presence_frequency)
    assert torch.equal(logits, before)

    expected = logits.clone()
    for row, token, penalty in ((0, 1, 2.0), (0, 4, 2.0), (2, 0, 0.5)):
        value = expected[row, token]
        expected[row, token] = value / penalty if value > 0 else value * penalty
    expected[2, 3] -= 0.5 + 1.0 * 2
    expected[2, 7] -= 0.5 + 1.0 * 1
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[1], logits[1])
    # Nothing to penalise: the very same tensor comes back, no copy.
    assert apply_penalties(logits, None, None, None, None) is logits
    only_counts = apply_penalties(logits, None, None, count_keys, presence_frequency)
    torch.testing.assert_close(only_counts[2, 3], logits[2, 3] - 2.5)


def test_mask_tokens_in_place() -> None:
    x = torch.zeros(2, 5)
    assert mask_tokens(x, [0, 1, 1], [4, 0, 2]) is x
    assert torch.isinf(x).nonzero().tolist() == [[0, 4], [1, 0], [1, 2]]
    assert mask_tokens(x, [], []) is x


def test_greedy_sample_is_argmax_with_ties_nan_and_masked_rows() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, (64, 1000), generator=g).float()  # many ties: first index wins
    x[5] = float("-inf")
    x[6, 17] = float("nan")
    assert torch.equal(greedy_sample(x), x.argmax(dim=-1))
    assert greedy_sample(x)[5] == 0 and greedy_sample(x)[6] == 17


def test_filter_min_p_keeps_the_ratio_to_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    x = probs.log()
    out = filter_min_p(x, torch.tensor([[0.0], [0.35], [1.0]]))
    kept = torch.isfinite(out).tolist()
    assert kept == [[True] * 4, [True, True, False, False], [True, False, False, False]]
    assert torch.equal(out[torch.isfinite(out)], x[torch.isfinite(out)])


def test_sample_by_cdf_boundaries_and_zero_mass() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.25, 0.0, 0.5, 0.0]] * 5)
    u = torch.tensor([0.0, 0.3, 0.5, 0.99, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    # cdf [0, .25, .5, .5, 1, 1]: the first index whose cdf exceeds u
    assert sample_by_cdf(probs, u).tolist() == [1, 2, 4, 4, 4]
    # Unnormalised rows: u scales the row's own total; zero-probability entries never drawn.
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0]]).expand(400, -1)
    drawn = sample_by_cdf(weights, grid(400))
    assert set(drawn.tolist()) == {1, 3}
    assert drawn.tolist().count(1) == 100


def test_top_k_keeps_exactly_the_k_best() -> None:
    x = torch.randn(1, 100, generator=torch.Generator().manual_seed(2)).expand(500, -1)
    best = set(x[0].topk(5).indices.tolist())
    for top_p in (1.0, 0.999):
        drawn = top_k_top_p_sample(x, torch.full((500, 1), 5), torch.full((500, 1), top_p),
                                   grid(500), num_candidates=5)
        assert set(drawn.tolist()) == best


def test_top_p_nucleus_is_the_shortest_prefix_reaching_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    x = probs.log().expand(80, -1)
    vocab = x.shape[1]
    drawn = top_k_top_p_sample(x, torch.full((80, 1), vocab), torch.full((80, 1), 0.75),
                               grid(80), num_candidates=vocab)
    # Nucleus {1, 3} (mass 0.8); within it token 1 holds 0.5 / 0.8 of the mass.
    assert drawn.tolist() == [1] * 50 + [3] * 30
    # A tiny top_p keeps the best token alone.
    alone = top_k_top_p_sample(x, torch.full((80, 1), vocab), torch.full((80, 1), 1e-6),
                               grid(80), num_candidates=vocab)
    assert set(alone.tolist()) == {1}


def reference_nucleus_draw(row: torch.Tensor, top_k: int, top_p: float, u: float) -> int:
    """One draw straight from the definitions, in float64 over a full sort."""
    values, ids = row.double().sort(descending=True)
    values = values[:top_k]
    probs = (values - torch.logsumexp(values if top_k < len(row) else row.double(), 0)).exp()
    keep = (probs.cumsum(0) - probs) < top_p
    keep[0] = True
    probs = probs * keep
    cdf = probs.cumsum(0)
    return int(ids[int(torch.searchsorted(cdf, u * cdf[-1], right=True))])


def test_nucleus_past_the_first_candidates_falls_back_to_a_full_sort() -> None:
    # Flat rows: a 0.9 nucleus holds ~900 of 1000 tokens, far past NUCLEUS_CANDIDATES.
    vocab = 1000
    x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 0.1
    x = x.expand(64, -1)
    u = grid(64)
    top_k = torch.full((64, 1), vocab)
    top_p = torch.full((64, 1), 0.9)
    assert num_nucleus_candidates([vocab], vocab) == NUCLEUS_CANDIDATES
    drawn = top_k_top_p_sample(x, top_k, top_p, u, NUCLEUS_CANDIDATES)
    assert torch.equal(drawn, top_k_top_p_sample(x, top_k, top_p, u, vocab))
    assert drawn.tolist() == [reference_nucleus_draw(x[0], vocab, 0.9, float(v)) for v in u]
    # Draws land past the first NUCLEUS_CANDIDATES tokens: the fallback really ran.
    rank = {token: r for r, token in enumerate(x[0].argsort(descending=True).tolist())}
    assert max(rank[t] for t in drawn.tolist()) >= NUCLEUS_CANDIDATES


def test_top_k_top_p_rows_are_independent_of_their_batch() -> None:
    vocab = 500
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, vocab, generator=g) * torch.tensor([[0.1], [1.0], [5.0], [1.0], [2.0],
                                                            [0.5]])
    top_k = [20, vocab, 3, 100, vocab, 7]
    top_p = [0.9, 0.95, 1.0, 0.5, 0.3, 0.99]
    u = torch.rand(6, dtype=torch.float64, generator=g)
    batch = top_k_top_p_sample(x, torch.tensor(top_k).unsqueeze(1),
                               torch.tensor(top_p).unsqueeze(1), u,
                               num_nucleus_candidates(top_k, vocab))
    for i in range(6):
        alone = top_k_top_p_sample(x[i:i + 1], torch.tensor([[top_k[i]]]),
                                   torch.tensor([[top_p[i]]]), u[i:i + 1],
                                   num_nucleus_candidates([top_k[i]], vocab))
        assert int(alone) == int(batch[i]) == reference_nucleus_draw(x[i], top_k[i], top_p[i],
                                                                     float(u[i]))


def test_gather_logprobs_of_raw_logits() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5)) * 2
    token_ids = torch.tensor([3, 1, 4, 1])
    chosen, values, ids = gather_logprobs(logits, token_ids, [0, 2], 5)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(chosen, reference[[0, 2], [3, 4]])
    torch.testing.assert_close(values, reference[[0, 2]].topk(5).values)
    assert torch.equal(ids, reference[[0, 2]].topk(5).indices)
    chosen, values, ids = gather_logprobs(logits, token_ids, [1], 0)
    assert chosen.shape == (1,) and values.shape == (1, 0) and ids.shape == (1, 0)
    assert ids.dtype == torch.long


@pytest.mark.parametrize("name", ["greedy_sample", "top_k_top_p_sample"])
def test_engine_sampler_goes_through_dispatch(name: str) -> None:
    from tasks.params import SamplingParams
    from workers.engine.sampler import sample
    from workers.engine.step_io import ScheduledSequence

    reference = dispatch.get(name, "cpu")
    calls = []

    def counting(*args):
        calls.append(args[0].shape)
        return reference(*args)

    params = SamplingParams(temperature=0.0 if name == "greedy_sample" else 1.0, top_k=3)
    seqs = [ScheduledSequence(i, [1], 0, [0], True, params, [1], []) for i in range(4)]
    logits = torch.randn(4, 32)
    dispatch.register(name, "cpu", counting)
    try:
        token_ids, _ = sample(logits, seqs)
    finally:
        dispatch.unregister(name, "cpu")
    assert calls == [(4, 32)]
    assert dispatch.get(name, "cpu") is reference
    assert len(token_ids) == 4
    assert getattr(kernels, name) is not None

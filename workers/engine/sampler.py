"""The sampler: one token per row of the last-position logits, pure torch on any device.

`sample(logits, seqs, eos_token_ids)` applies, in order and only to the rows that ask:

1. penalties: repetition (HF/CTRL: divide positive logits, multiply negative ones, over the
   prompt and output tokens), then presence and frequency (OpenAI: over output tokens);
2. `min_tokens`: while a sequence has fewer output tokens than that, its stop token ids and
   (unless `ignore_eos`, in which case EOS never stops it anyway) the EOS ids are masked;
3. greedy rows (temperature 0) take the argmax; the others are divided by their
   temperature, filtered by min-p, top-k and top-p, and sampled by inverse CDF: one
   uniform u per row picks the first token whose cumulative probability exceeds u.

Seeded rows take u from a stable hash of `(params.seed, len(output_token_ids))`: the token
a seeded sequence draws at a given step depends only on its own logits, never on its batch
companions, its row, or preemption. Unseeded rows use torch's global generator. One
uniform per row (rather than Gumbel / exponential noise over the whole vocabulary) keeps
the random-number cost independent of the vocabulary size.
NOTE: every step is computed row by row (softmax, prefix sums over candidates sorted best
first), so a row's numbers do not depend on the batch; on one device type the draw is
bit-for-bit the same. Across device types the logits themselves differ.

Logprobs (when `params.logprobs` is not None) come from the log-softmax of the model's raw
logits, before penalties, masking and temperature: they describe what the model predicted,
the same whatever sampling settings the client chose.
"""

from __future__ import annotations

import logging
from array import array
from itertools import chain

import torch

from tasks.params import SamplingParams
from workers.engine.step_io import ScheduledSequence, TokenLogprobs

logger = logging.getLogger(__name__)

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1
# Candidates tried first for a top-p nucleus; a full sort of the vocabulary costs far more.
_NUCLEUS_CANDIDATES = 256


def sample(
    logits: torch.Tensor,
    seqs: list[ScheduledSequence],
    eos_token_ids: list[int] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of `logits` ([len(seqs), vocab], float32).

    Row i belongs to `seqs[i]` (its params, prompt and output token ids). `eos_token_ids`
    are masked for rows still short of `params.min_tokens`. Returns the sampled token ids
    and, per row, its `TokenLogprobs` or None when the row did not ask for logprobs.
    `logits` is never modified.
    """
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(
            f"logits must be [num_seqs={len(seqs)}, vocab], got {tuple(logits.shape)}"
        )
    if not seqs:
        return [], []
    params = [s.params for s in seqs]
    is_greedy = [p.temperature < _MIN_TEMPERATURE for p in params]

    scores = apply_penalties(logits, seqs)
    scores = _mask_min_tokens(scores, seqs, eos_token_ids or [], copied=scores is not logits)

    if all(is_greedy):
        token_ids = scores.argmax(dim=-1)
    else:
        token_ids = _sample_rows(scores, seqs, is_greedy)

    token_list: list[int] = token_ids.tolist()
    return token_list, _gather_logprobs(logits, token_ids, token_list, seqs)


def _flat_keys(rows: list[int], token_lists: list[list[int]], vocab_size: int,
               device: torch.device) -> torch.Tensor:
    """`row * vocab + token` for every token of every list: indices into the flattened
    logits, so penalties cost O(tokens), never a [rows, vocab] temporary."""
    lengths = [len(t) for t in token_lists]
    if sum(lengths) == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    # array + frombuffer: half the cost of torch.tensor over a Python list of ints.
    flat_ids = torch.frombuffer(array("q", chain.from_iterable(token_lists)), dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths))
    return (row_ids * vocab_size + flat_ids).to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """Return `logits` itself when no row has a penalty, else a penalised copy.

    Repetition first (HF/CTRL, over each distinct prompt or output token), then presence
    and frequency (OpenAI: `logit -= presence * (count > 0) + frequency * count` over output
    tokens). Only the touched entries are read and written.
    """
    rep_rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    freq_rows = [
        i for i, s in enumerate(seqs)
        if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0
    ]
    if not rep_rows and not freq_rows:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    out = logits.contiguous().clone()
    flat = out.view(-1)

    if rep_rows:
        keys = _flat_keys(
            rep_rows,
            [seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in rep_rows],
            vocab_size,
            device,
        ).unique()
        rep_by_row = torch.ones(len(seqs), dtype=out.dtype, device=device)
        rep_by_row[rep_rows] = torch.tensor(
            [seqs[i].params.repetition_penalty for i in rep_rows], dtype=out.dtype, device=device
        )
        rep = rep_by_row[keys // vocab_size]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / rep, values * rep)

    output_lists = [seqs[i].output_token_ids for i in freq_rows]
    if any(output_lists):
        keys, counts = _flat_keys(freq_rows, output_lists, vocab_size, device).unique(
            return_counts=True
        )
        # [len(seqs), 2]: (presence, frequency) per row, zero for rows without them.
        weights = torch.zeros((len(seqs), 2), dtype=out.dtype, device=device)
        weights[freq_rows] = torch.tensor(
            [[seqs[i].params.presence_penalty, seqs[i].params.frequency_penalty]
             for i in freq_rows],
            dtype=out.dtype,
            device=device,
        )
        key_weights = weights[keys // vocab_size]
        penalty = key_weights[:, 0] + key_weights[:, 1] * counts.to(out.dtype)
        flat.index_add_(0, keys, -penalty)
    return out


def _mask_min_tokens(
    scores: torch.Tensor, seqs: list[ScheduledSequence], eos_token_ids: list[int], copied: bool
) -> torch.Tensor:
    """Mask stop ids of rows short of min_tokens; copy `scores` first unless `copied`."""
    rows: list[int] = []
    cols: list[int] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
            # NOTE: with ignore_eos, EOS does not end the sequence, so it needs no mask.
            ids = p.stop_token_ids if p.ignore_eos else p.stop_token_ids + eos_token_ids
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if not rows:
        return scores
    if not copied:
        scores = scores.clone()
    scores[rows, cols] = float("-inf")
    return scores


def _uniform_for_step(seed: int, step: int) -> float:
    """A uniform in [0, 1) from (request seed, output index): splitmix64, no torch RNG, so
    the value is the same on every device, process and torch version."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


def _uniforms(seqs: list[ScheduledSequence], device: torch.device) -> torch.Tensor:
    """[len(seqs)] float64: seeded rows from their own stream, the others from torch's."""
    u = torch.rand(len(seqs), dtype=torch.float64, device=device)
    seeded = [i for i, s in enumerate(seqs) if s.params.seed is not None]
    if seeded:
        values = [
            _uniform_for_step(seqs[i].params.seed or 0, len(seqs[i].output_token_ids))
            for i in seeded
        ]
        u[seeded] = torch.tensor(values, dtype=torch.float64, device=device)
    return u


def _sample_rows(
    scores: torch.Tensor, seqs: list[ScheduledSequence], is_greedy: list[bool]
) -> torch.Tensor:
    """Greedy rows take the argmax; the others are tempered, filtered and sampled."""
    device = scores.device
    vocab_size = scores.shape[1]
    token_ids = scores.argmax(dim=-1) if any(is_greedy) else None
    rows = [i for i, g in enumerate(is_greedy) if not g]
    all_rows = token_ids is None
    params = [seqs[i].params for i in rows]

    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    x = (scores if all_rows else scores[rows]) / temperature
    if any(p.min_p > 0.0 for p in params):
        x = _filter_min_p(x, [p.min_p for p in params])
    u = _uniforms([seqs[i] for i in rows], device)

    filtered = [j for j, p in enumerate(params) if 0 < p.top_k < vocab_size or p.top_p < 1.0]
    if not filtered:
        sampled = _sample_by_cdf(x.softmax(dim=-1), u)
    elif len(filtered) == len(rows):
        sampled = _sample_top_k_top_p(x, params, u)
    else:
        filtered_set = set(filtered)
        plain = [j for j in range(len(rows)) if j not in filtered_set]
        sampled = torch.empty(len(rows), dtype=torch.long, device=device)
        sampled[plain] = _sample_by_cdf(x[plain].softmax(dim=-1), u[plain])
        sampled[filtered] = _sample_top_k_top_p(
            x[filtered], [params[j] for j in filtered], u[filtered]
        )
    if token_ids is None:
        return sampled
    token_ids[rows] = sampled
    return token_ids


def _sample_by_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i picks the first index whose cumulative mass exceeds
    u[i] times the row's total, so zero-probability entries are never picked."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = (u.unsqueeze(1) * total.double()).to(cdf.dtype)
    # NOTE: float rounding may lift u * total up to total; stay strictly below it.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _sample_top_k_top_p(
    x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """Sample within each row's top-k, then within its top-p nucleus.

    Works on the best candidates only (`topk`, not a full-vocabulary sort): rows with a
    top-k need their k best; rows with only a top-p need as many as hold top_p of the
    mass, tried with _NUCLEUS_CANDIDATES first and the whole sorted vocabulary if short.
    """
    vocab_size = x.shape[1]
    device = x.device
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    wanted = max(k if k < vocab_size else min(_NUCLEUS_CANDIDATES, vocab_size) for k in top_k)
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    # Rows without top-k normalise over the whole vocabulary, the others over their k best.
    full_norm = k >= vocab_size
    log_total = torch.logsumexp(x, dim=-1, keepdim=True)

    while True:
        if wanted < vocab_size:
            values, ids = x.topk(wanted, dim=-1)
        else:
            values, ids = x.sort(dim=-1, descending=True)
        ranks = torch.arange(values.shape[1], device=device).unsqueeze(0)
        values = values.masked_fill(ranks >= k, float("-inf"))
        log_norm = torch.where(full_norm, log_total, torch.logsumexp(values, dim=-1, keepdim=True))
        probs = (values - log_norm).exp()
        if wanted >= vocab_size or bool((probs.sum(-1, keepdim=True) >= p)[full_norm].all()):
            break
        logger.debug("top-p nucleus beyond %d candidates: sorting the vocabulary", wanted)
        wanted = vocab_size

    mass_before = probs.cumsum(dim=-1) - probs
    # The nucleus is the shortest prefix whose mass reaches top_p; the best token stays.
    outside = mass_before >= p
    outside[:, 0] = False
    probs = probs.masked_fill(outside, 0.0)
    return ids.gather(1, _sample_by_cdf(probs, u).unsqueeze(1)).squeeze(1)


def _filter_min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's best, in log space.

    Applied before top-k/top-p: min-p keeps a ratio to the best token, which renormalising
    over a subset containing the best token does not change, so the order is immaterial.
    """
    threshold = torch.tensor(min_p, device=x.device).unsqueeze(1)
    best = x.max(dim=-1, keepdim=True).values
    # log(0) = -inf keeps everything for rows with min_p == 0.
    return x.masked_fill(x < best + threshold.log(), float("-inf"))


def _gather_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    token_list: list[int],
    seqs: list[ScheduledSequence],
) -> list[TokenLogprobs | None]:
    """Raw-model logprobs of the sampled token and the top-n, for the rows that asked."""
    result: list[TokenLogprobs | None] = [None] * len(seqs)
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return result
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
    num_top = max(seqs[i].params.logprobs or 0 for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if num_top > 0:
        values, ids = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        n = seqs[i].params.logprobs or 0
        result[i] = TokenLogprobs(
            token_id=token_list[i],
            logprob=chosen[j],
            top=list(zip(top_ids[j][:n], top_values[j][:n])),
        )
    return result

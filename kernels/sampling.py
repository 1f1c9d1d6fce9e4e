"""Sampling kernels: penalties, token masks, min-p / top-k / top-p filters, inverse-CDF
draws and logprobs, as tensor functions over a batch of rows of logits.

Each function takes tensors (and plain lists of ints where indexing by a list costs less
than building a tensor first) and knows nothing of requests or their parameters: the
engine's sampler (`workers/engine/sampler.py`) turns the step's rows into these inputs once
per step and calls the functions in its documented order.

NOTE: every function is row-independent: softmax, log-sum-exp, prefix sums over candidates
sorted best first, all within one row, so a row's numbers never depend on its batch
companions or on its position; on one device type a row's result is bit-for-bit the same
in any batch. These pure-torch versions are the reference; a backend may register faster
ones with `kernels.dispatch` (same names and signatures).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Candidates tried first for a top-p nucleus; a full sort of the vocabulary costs far more.
NUCLEUS_CANDIDATES = 256


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab] float
    repetition_keys: torch.Tensor | None,  # [num_keys] int64, row * vocab + token
    repetition_penalties: torch.Tensor | None,  # [num_rows] float, 1.0 on rows without
    count_keys: torch.Tensor | None,  # [num_counted] int64, row * vocab + token
    presence_frequency: torch.Tensor | None,  # [num_rows, 2] float, zeros on rows without
) -> torch.Tensor:
    """Penalise the entries named by flat keys (`row * vocab + token`) of `logits`.

    Returns `logits` itself when both key tensors are None, else a penalised copy.
    Repetition first (HF/CTRL: positive logits divided by the row's penalty, negative ones
    multiplied, once per distinct key of `repetition_keys`), then presence and frequency
    (OpenAI: `logit -= presence + frequency * count`, where count is how many times the
    key occurs in `count_keys`). Only the touched entries are read and written: the cost is
    O(keys), never a [rows, vocab] temporary.
    """
    if repetition_keys is None and count_keys is None:
        return logits
    vocab_size = logits.shape[1]
    out = logits.contiguous().clone()
    flat = out.view(-1)
    if repetition_keys is not None and repetition_penalties is not None:
        keys = repetition_keys.unique()
        rep = repetition_penalties.to(out.dtype)[keys // vocab_size]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / rep, values * rep)
    if count_keys is not None and presence_frequency is not None:
        keys, counts = count_keys.unique(return_counts=True)
        key_weights = presence_frequency.to(out.dtype)[keys // vocab_size]
        penalty = key_weights[:, 0] + key_weights[:, 1] * counts.to(out.dtype)
        flat.index_add_(0, keys, -penalty)
    return out


def mask_tokens(x: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """Set `x[rows[i], token_ids[i]]` to -inf for every i, in place; returns `x`."""
    if rows:
        x[rows, token_ids] = float("-inf")
    return x


def apply_token_bitmask(
    x: torch.Tensor,  # [num_rows, vocab] float, written in place
    bitmask: torch.Tensor,  # [len(rows), ceil(vocab / 32)] int32, on x's device
    rows: list[int],  # the row of x that each bitmask row constrains
) -> torch.Tensor:
    """Set to -inf every token a row's bitmask does not allow (bit j of word w allows
    token 32 * w + j), in place; returns `x`. Rows not named are left alone."""
    if not rows:
        return x
    vocab_size = x.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    # NOTE: >> of a negative int32 is arithmetic, but only bit 0 is kept after it.
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab_size]
    disallowed = allowed == 0
    # NOTE: row by row in place: no gather / scatter copies of [len(rows), vocab]
    for j, row in enumerate(rows):
        x[row].masked_fill_(disallowed[j], float("-inf"))
    return x


def greedy_sample(x: torch.Tensor) -> torch.Tensor:  # x [num_rows, vocab] -> [num_rows] int64
    """The index of each row's largest value (the first one on ties), as `argmax`."""
    # NOTE: `max(dim).indices` is documented to equal `argmax` (first maximal index, NaN
    # counts as maximal) and runs several times faster on CPU over a large vocabulary.
    return x.max(dim=-1).indices


def filter_min_p(
    x: torch.Tensor,  # [num_rows, vocab] float, tempered logits
    min_p: torch.Tensor,  # [num_rows, 1] float in [0, 1]
) -> torch.Tensor:
    """Drop (set to -inf) tokens whose probability is below min_p times the row's best, in
    log space; returns a new tensor.

    Applied before top-k/top-p: min-p keeps a ratio to the best token, which renormalising
    over a subset containing the best token does not change, so the order is immaterial.
    """
    # NOTE: amax may return -0.0 where max returns 0.0 (or back); best + log(min_p) is the
    # same either way, since log(min_p) is 0.0, negative or -inf.
    best = x.amax(dim=-1, keepdim=True)
    # log(0) = -inf keeps everything for rows with min_p == 0.
    return x.masked_fill(x < best + min_p.log(), float("-inf"))


def sample_by_cdf(
    probs: torch.Tensor,  # [num_rows, n] float, unnormalised probabilities >= 0
    u: torch.Tensor,  # [num_rows] float64 in [0, 1)
) -> torch.Tensor:  # [num_rows] int64 column indices
    """Inverse-CDF sampling: row i picks the first index whose cumulative mass exceeds
    u[i] times the row's total, so zero-probability entries are never picked."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = (u.unsqueeze(1) * total.double()).to(cdf.dtype)
    # NOTE: float rounding may lift u * total up to total; stay strictly below it.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def num_nucleus_candidates(top_k: list[int], vocab_size: int) -> int:
    """The `num_candidates` for `top_k_top_p_sample`: every row's k (vocab_size meaning no
    top-k), with NUCLEUS_CANDIDATES standing for the rows without a top-k."""
    return max(k if k < vocab_size else min(NUCLEUS_CANDIDATES, vocab_size) for k in top_k)


def top_k_top_p_sample(
    x: torch.Tensor,  # [num_rows, vocab] float, tempered (and min-p filtered) logits
    top_k: torch.Tensor,  # [num_rows, 1] int64 in [1, vocab]; vocab means no top-k
    top_p: torch.Tensor,  # [num_rows, 1] float in (0, 1]; 1.0 means no top-p
    u: torch.Tensor,  # [num_rows] float64 in [0, 1)
    num_candidates: int,  # best tokens tried first: num_nucleus_candidates(top_k, vocab)
) -> torch.Tensor:  # [num_rows] int64 token ids
    """Sample within each row's top-k, then within its top-p nucleus.

    Works on the best candidates only (`topk`, not a full-vocabulary sort): rows with a
    top-k need their k best; rows with only a top-p need as many as hold top_p of the
    mass, tried with `num_candidates` first and the whole sorted vocabulary if short.
    """
    vocab_size = x.shape[1]
    device = x.device
    wanted = num_candidates
    # Rows without top-k normalise over the whole vocabulary, the others over their k best.
    full_norm = top_k >= vocab_size
    log_total = torch.logsumexp(x, dim=-1, keepdim=True)

    while True:
        if wanted < vocab_size:
            values, ids = x.topk(wanted, dim=-1)
        else:
            values, ids = x.sort(dim=-1, descending=True)
        ranks = torch.arange(values.shape[1], device=device).unsqueeze(0)
        values = values.masked_fill(ranks >= top_k, float("-inf"))
        log_norm = torch.where(full_norm, log_total, torch.logsumexp(values, dim=-1, keepdim=True))
        probs = (values - log_norm).exp()
        if wanted >= vocab_size or bool((probs.sum(-1, keepdim=True) >= top_p)[full_norm].all()):
            break
        logger.debug("top-p nucleus beyond %d candidates: sorting the vocabulary", wanted)
        wanted = vocab_size

    mass_before = probs.cumsum(dim=-1) - probs
    # The nucleus is the shortest prefix whose mass reaches top_p; the best token stays.
    outside = mass_before >= top_p
    outside[:, 0] = False
    probs = probs.masked_fill(outside, 0.0)
    return ids.gather(1, sample_by_cdf(probs, u).unsqueeze(1)).squeeze(1)


def gather_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] float, raw model logits
    token_ids: torch.Tensor,  # [num_rows] int64, the sampled tokens
    rows: list[int],  # the rows that asked for logprobs
    num_top: int,  # top-n to return for each of them (>= 0)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax (float32) of `logits[rows]`: the sampled token's logprob [len(rows)],
    and the `num_top` best logprobs [len(rows), num_top] with their token ids (int64),
    best first."""
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
    else:
        top_values = logprobs.new_empty((len(rows), 0))
        top_ids = torch.empty((len(rows), 0), dtype=torch.long, device=logits.device)
    return chosen, top_values, top_ids

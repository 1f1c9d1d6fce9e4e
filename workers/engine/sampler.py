"""The sampler: one token per row of the last-position logits, on any device.

`sample(logits, seqs, eos_token_ids)` applies, in order and only to the rows that ask:

1. penalties: repetition (HF/CTRL: divide positive logits, multiply negative ones, over the
   prompt and output tokens), then presence and frequency (OpenAI: over output tokens);
2. `min_tokens`: while a sequence has fewer output tokens than that, its stop token ids and
   (unless `ignore_eos`, in which case EOS never stops it anyway) the EOS ids are masked;
   structured outputs: a constrained row's tokens outside its grammar bitmask
   (`SchedulerOutput.grammar_bitmask`) are masked too;
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

This module is the engine side: it reads the rows' `SamplingParams` and token lists once
per step into a `SamplingMetadata` (`build_sampling_metadata`), then runs the tensor
kernels of `kernels/sampling.py` (through `kernels.dispatch`, so a backend may replace
them) in the order above (`sample_with_metadata`).
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from itertools import chain
from typing import cast

import torch

import kernels
from kernels.sampling import mask_tokens, num_nucleus_candidates
from workers.engine.step_io import GrammarBitmask, ScheduledSequence, TokenLogprobs

logger = logging.getLogger(__name__)

# Temperatures below this are treated as greedy: dividing by them overflows float32 logits.
_MIN_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingMetadata:
    """One step's sampling inputs, built once from the scheduled rows.

    Row i is `seqs[i]` of `build_sampling_metadata`; tensors are on the logits' device.
    """

    num_rows: int
    # Penalties (None when no row has one): flat keys `row * vocab + token` of the
    # logits. Repetition keys cover the prompt and output tokens of the rows with a
    # repetition penalty; count keys each output token (once per occurrence) of the rows
    # with a presence or frequency penalty (None as well when those rows have no output).
    repetition_keys: torch.Tensor | None  # [num_keys] int64
    # NOTE: the weights are float64, exactly the requested numbers: the kernel rounds them
    # once to the logits' dtype.
    repetition_penalties: torch.Tensor | None  # [num_rows] float64, 1.0 on rows without
    count_keys: torch.Tensor | None  # [num_counted] int64
    presence_frequency: torch.Tensor | None  # [num_rows, 2] float64, zeros on rows without
    # min_tokens: (row, token id) pairs masked to -inf, the stop (and EOS) ids of the rows
    # still short of their min_tokens.
    masked_rows: list[int]
    masked_token_ids: list[int]
    # Structured outputs: the rows constrained by a grammar, and their allowed tokens
    # (bit j of word w allows token 32 * w + j); None when no row is constrained.
    bitmask_rows: list[int]
    bitmask: torch.Tensor | None  # [len(bitmask_rows), ceil(vocab / 32)] int32
    # Rows drawn at random (temperature >= _MIN_TEMPERATURE), in row order; the others
    # take the argmax. Every tensor below has one row per entry of random_rows.
    random_rows: list[int]
    temperatures: torch.Tensor | None  # [num_random, 1] float32
    min_p: torch.Tensor | None  # [num_random, 1] float32; None when no random row has one
    uniforms: torch.Tensor | None  # [num_random] float64 in [0, 1): seeded or torch's
    # Positions in random_rows (not rows) with a top-k or a top-p, and those without.
    filtered: list[int]
    unfiltered: list[int]
    top_k: torch.Tensor | None  # [num_filtered, 1] int64; vocab for rows without a top-k
    top_p: torch.Tensor | None  # [num_filtered, 1] float32; 1.0 for rows without
    num_candidates: int  # best tokens top_k_top_p_sample tries first
    # Logprobs: the rows that asked, and the top-n each asked for.
    logprob_rows: list[int]
    num_logprobs: list[int]  # one per entry of logprob_rows


def sample(
    logits: torch.Tensor,
    seqs: list[ScheduledSequence],
    eos_token_ids: list[int] | None = None,
    grammar_bitmask: GrammarBitmask | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of `logits` ([len(seqs), vocab], float32).

    Row i belongs to `seqs[i]` (its params, prompt and output token ids). `eos_token_ids`
    are masked for rows still short of `params.min_tokens`; the rows of the sequences in
    `grammar_bitmask` sample only the tokens their bitmask allows. Returns the sampled token ids
    and, per row, its `TokenLogprobs` or None when the row did not ask for logprobs.
    `logits` is never modified.
    """
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(
            f"logits must be [num_seqs={len(seqs)}, vocab], got {tuple(logits.shape)}"
        )
    if not seqs:
        return [], []
    metadata = build_sampling_metadata(seqs, eos_token_ids or [], logits.shape[1],
                                       logits.device, grammar_bitmask)
    return sample_with_metadata(logits, metadata)


def build_sampling_metadata(
    seqs: list[ScheduledSequence],
    eos_token_ids: list[int],
    vocab_size: int,
    device: torch.device,
    grammar_bitmask: GrammarBitmask | None = None,
) -> SamplingMetadata:
    """Read every row's params and token lists once into the step's `SamplingMetadata`.

    NOTE: draws the unseeded rows' uniforms from torch's global generator, so build it
    once per step, right before sampling.
    """
    masked_rows: list[int] = []
    masked_token_ids: list[int] = []
    logprob_rows: list[int] = []
    num_logprobs: list[int] = []
    random_rows: list[int] = []
    temperatures: list[float] = []
    min_p: list[float] = []
    seeded: list[int] = []  # positions in random_rows
    seeded_uniforms: list[float] = []
    filtered: list[int] = []
    unfiltered: list[int] = []
    top_k: list[int] = []
    top_p: list[float] = []
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.min_tokens and len(seq.output_token_ids) < p.min_tokens:
            # NOTE: with ignore_eos, EOS does not end the sequence, so it needs no mask.
            ids = p.stop_token_ids if p.ignore_eos else p.stop_token_ids + eos_token_ids
            masked_rows.extend([i] * len(ids))
            masked_token_ids.extend(ids)
        if p.logprobs is not None:
            logprob_rows.append(i)
            num_logprobs.append(p.logprobs)
        if p.temperature < _MIN_TEMPERATURE:
            continue
        j = len(random_rows)
        random_rows.append(i)
        temperatures.append(p.temperature)
        min_p.append(p.min_p)
        if p.seed is not None:
            seeded.append(j)
            seeded_uniforms.append(_uniform_for_step(p.seed, len(seq.output_token_ids)))
        if 0 < p.top_k < vocab_size or p.top_p < 1.0:
            filtered.append(j)
            top_k.append(p.top_k if 0 < p.top_k < vocab_size else vocab_size)
            top_p.append(p.top_p)
        else:
            unfiltered.append(j)

    temperatures_t = min_p_t = uniforms = top_k_t = top_p_t = None
    if random_rows:
        temperatures_t = torch.tensor(temperatures, device=device).unsqueeze(1)
        if any(v > 0.0 for v in min_p):
            min_p_t = torch.tensor(min_p, device=device).unsqueeze(1)
        uniforms = torch.rand(len(random_rows), dtype=torch.float64, device=device)
        if seeded:
            uniforms[seeded] = torch.tensor(seeded_uniforms, dtype=torch.float64,
                                            device=device)
    if filtered:
        top_k_t = torch.tensor(top_k, device=device).unsqueeze(1)
        top_p_t = torch.tensor(top_p, device=device).unsqueeze(1)
    repetition_keys, repetition_penalties, count_keys, presence_frequency = (
        _penalty_inputs(seqs, vocab_size, device))
    bitmask_rows, bitmask = _bitmask_inputs(seqs, grammar_bitmask, device)
    return SamplingMetadata(
        num_rows=len(seqs),
        repetition_keys=repetition_keys,
        repetition_penalties=repetition_penalties,
        count_keys=count_keys,
        presence_frequency=presence_frequency,
        masked_rows=masked_rows,
        masked_token_ids=masked_token_ids,
        bitmask_rows=bitmask_rows,
        bitmask=bitmask,
        random_rows=random_rows,
        temperatures=temperatures_t,
        min_p=min_p_t,
        uniforms=uniforms,
        filtered=filtered,
        unfiltered=unfiltered,
        top_k=top_k_t,
        top_p=top_p_t,
        num_candidates=num_nucleus_candidates(top_k, vocab_size) if top_k else 0,
        logprob_rows=logprob_rows,
        num_logprobs=num_logprobs,
    )


def sample_with_metadata(
    logits: torch.Tensor, metadata: SamplingMetadata
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """`sample` over inputs already read from the rows: penalties, min_tokens masks,
    greedy argmax or tempered / filtered draws, then logprobs of the raw logits."""
    m = metadata
    scores = kernels.apply_penalties(logits, m.repetition_keys, m.repetition_penalties,
                                     m.count_keys, m.presence_frequency)
    if m.masked_rows:
        if scores is logits:
            scores = scores.clone()
        mask_tokens(scores, m.masked_rows, m.masked_token_ids)
    if m.bitmask is not None:
        if scores is logits:
            scores = scores.clone()
        kernels.apply_token_bitmask(scores, m.bitmask, m.bitmask_rows)

    if not m.random_rows:
        token_ids = kernels.greedy_sample(scores)
    else:
        token_ids = _sample_random_rows(scores, m, owned=scores is not logits)

    token_list: list[int] = token_ids.tolist()
    return token_list, _logprobs(logits, token_ids, token_list, m)


def apply_penalties(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """Return `logits` itself when no row has a penalty, else a penalised copy (step 1 of
    `sample` alone, for the rows' params)."""
    return kernels.apply_penalties(logits, *_penalty_inputs(seqs, logits.shape[1],
                                                            logits.device))


def _penalty_inputs(
    seqs: list[ScheduledSequence], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None]:
    """(repetition_keys, repetition_penalties, count_keys, presence_frequency) of
    `SamplingMetadata`."""
    rep_rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0]
    freq_rows = [
        i for i, s in enumerate(seqs)
        if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0
    ]
    repetition_keys = repetition_penalties = count_keys = presence_frequency = None
    if rep_rows:
        repetition_keys = _flat_keys(
            rep_rows,
            [seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in rep_rows],
            vocab_size,
            device,
        )
        repetition_penalties = torch.tensor(
            [s.params.repetition_penalty for s in seqs], dtype=torch.float64, device=device
        )
    output_lists = [seqs[i].output_token_ids for i in freq_rows]
    if any(output_lists):
        count_keys = _flat_keys(freq_rows, output_lists, vocab_size, device)
        presence_frequency = torch.tensor(
            [[s.params.presence_penalty, s.params.frequency_penalty] for s in seqs],
            dtype=torch.float64,
            device=device,
        )
    return repetition_keys, repetition_penalties, count_keys, presence_frequency


def _bitmask_inputs(
    seqs: list[ScheduledSequence], grammar_bitmask: GrammarBitmask | None,
    device: torch.device,
) -> tuple[list[int], torch.Tensor | None]:
    """(bitmask_rows, bitmask) of `SamplingMetadata`: each bitmask row's logits row."""
    if grammar_bitmask is None or not grammar_bitmask.seq_ids:
        return [], None
    row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
    rows = [row_of[seq_id] for seq_id in grammar_bitmask.seq_ids]
    return rows, torch.from_numpy(grammar_bitmask.bitmask).to(device)


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


def _uniform_for_step(seed: int, step: int) -> float:
    """A uniform in [0, 1) from (request seed, output index): splitmix64, no torch RNG, so
    the value is the same on every device, process and torch version."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


def _sample_random_rows(scores: torch.Tensor, m: SamplingMetadata, owned: bool) -> torch.Tensor:
    """Greedy rows take the argmax; the random ones are tempered, filtered and sampled.
    `owned`: `scores` is the sampler's own copy, free to be overwritten."""
    rows = m.random_rows
    any_greedy = len(rows) < m.num_rows
    token_ids = kernels.greedy_sample(scores) if any_greedy else None
    temperatures = m.temperatures
    assert temperatures is not None and m.uniforms is not None  # set with random_rows
    # Divide in place when the tensor is ours (the gathered rows are a fresh copy) and
    # keeps the quotient's dtype: the same numbers without a [rows, vocab] temporary.
    in_place = torch.promote_types(scores.dtype, temperatures.dtype) == scores.dtype
    if any_greedy:
        x = scores[rows]
        x = x.div_(temperatures) if in_place else x / temperatures
    elif owned and in_place:
        x = scores.div_(temperatures)
    else:
        x = scores / temperatures
    if m.min_p is not None:
        x = kernels.filter_min_p(x, m.min_p)
    u = m.uniforms

    if not m.filtered:
        sampled = kernels.sample_by_cdf(x.softmax(dim=-1), u)
    elif not m.unfiltered:  # (top_k and top_p are set while a row is filtered)
        sampled = kernels.top_k_top_p_sample(x, cast(torch.Tensor, m.top_k),
                                             cast(torch.Tensor, m.top_p), u, m.num_candidates)
    else:
        plain, filtered = m.unfiltered, m.filtered
        sampled = torch.empty(len(rows), dtype=torch.long, device=scores.device)
        sampled[plain] = kernels.sample_by_cdf(x[plain].softmax(dim=-1), u[plain])
        sampled[filtered] = kernels.top_k_top_p_sample(
            x[filtered], cast(torch.Tensor, m.top_k), cast(torch.Tensor, m.top_p),
            u[filtered], m.num_candidates)
    if token_ids is None:
        return sampled
    token_ids[rows] = sampled
    return token_ids


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, token_list: list[int], m: SamplingMetadata
) -> list[TokenLogprobs | None]:
    """Raw-model logprobs of the sampled token and the top-n, for the rows that asked."""
    result: list[TokenLogprobs | None] = [None] * m.num_rows
    if not m.logprob_rows:
        return result
    chosen, top_values, top_ids = kernels.gather_logprobs(
        logits, token_ids, m.logprob_rows, max(m.num_logprobs)
    )
    chosen_list: list[float] = chosen.tolist()
    values_list: list[list[float]] = top_values.tolist()
    ids_list: list[list[int]] = top_ids.tolist()
    for j, (i, n) in enumerate(zip(m.logprob_rows, m.num_logprobs)):
        result[i] = TokenLogprobs(
            token_id=token_list[i],
            logprob=chosen_list[j],
            top=list(zip(ids_list[j][:n], values_list[j][:n])),
        )
    return result

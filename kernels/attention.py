"""Paged attention over a block-major KV cache (the reference implementations).

The cache is ONE tensor `[num_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]`;
a layer sees `kv_cache[:, 0, layer]` (K) and `kv_cache[:, 1, layer]` (V), each
`[num_blocks, block_size, num_kv_heads, head_dim]`. A token's slot is
`block_id * block_size + offset`.

One step mixes two kinds of work, both described by `AttentionMetadata`:
* chunks: several tokens of one sequence (a prompt, or a piece of it after a cached
  prefix): causal within the chunk, full over the prefix;
* decodes: one token per sequence. Each sequence's own blocks are copied out of the
  layer's cache (one `index_select` of whole block rows, no padding to the longest table)
  and used at once while the copy is still in cache; it attends over its exact context
  length: no mask, no padded keys. (`benchmarks/bench_attention.py` compares this with a
  padded batched gather, one flat gather for all sequences, and a fully vectorized
  segment softmax.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

# Decodes of nearly equal context lengths run together as one padded group: its padded
# slots are at most this multiple of the real ones.
_MAX_PADDING = 1.25
# ... and, on CPU, one layer's padded gather of a group's keys is at most this big. A
# group's gather and its transposed copy must stay in cache for the matmuls that read
# them; a loop over single sequences costs ~8 small ops per sequence and layer instead.
# (Zen 4, fp32: 64 decodes of 256 tokens padded in one 4 MiB gather 4.2 ms, per sequence
# 1.7 ms; 64 of 64 tokens, 1 MiB: 0.28 ms padded, 1.3 ms per sequence.)
_MAX_GROUP_GATHER_BYTES_CPU = 1024 * 1024

# `DecodeBatch.grouping` (max_group_blocks, None for no limit; block_size; table lengths;
# the tables end to end)
_Grouping = tuple[int | None, int, list[int], list[int]]


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # row of the chunk's first token in the flattened batch
    num_tokens: int  # per sequence
    start_pos: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor | None  # [num_context_blocks] int64; None when start_pos == 0
    mask: torch.Tensor | None  # [num_tokens, start_pos + num_tokens] bool, True = attend
    # fresh prompts of the same length, adjacent in the batch, attend as one batch
    # (rows token_start .. token_start + num_seqs * num_tokens); 1 for any other chunk
    num_seqs: int = 1


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of nearly equal context lengths, attended to as one padded batch."""

    members: torch.Tensor | None  # [n] int64 indices into the step's decodes; None = all
    tables: torch.Tensor  # [n, max_num_blocks] int64, padded with each one's first block
    mask: torch.Tensor  # [n, 1, 1, max_num_blocks * block_size] bool, True = a real key


@dataclass(slots=True)
class DecodeBatch:
    rows: torch.Tensor  # [num_decodes] int64, rows in the flattened batch
    rows_are_all: bool  # the rows are exactly 0..num_tokens-1 (a pure decode step)
    block_tables: list[torch.Tensor]  # per decode: [num_context_blocks] int64, unpadded
    context_lens: list[int]  # [num_decodes] tokens each decode attends to (new one included)
    all_tables: torch.Tensor | None = None  # [sum of table lengths] the tables end to end
    # what a backend's decode derives from the fields above, once per step (it reads
    # every layer the same metadata)
    backend_cache: dict | None = None
    # how `groups` and `singles` are made, on first use: a decode that reads the cache
    # blocks in place (a backend's) never needs them
    # (max_group_blocks, block_size, each table's length, the tables end to end as a
    # host list: grouping reads no device tensor back)
    grouping: _Grouping | None = None
    _groups: list[DecodeGroup] | None = None
    _singles: list[int] | None = None

    @property
    def groups(self) -> list[DecodeGroup]:
        """Padded groups of nearly equal context lengths; the decodes in none run one by
        one."""
        if self._groups is None:
            self._group()
        return self._groups  # type: ignore[return-value]

    @property
    def singles(self) -> list[int]:
        """Indices of the decodes that run one by one."""
        if self._singles is None:
            self._group()
        return self._singles  # type: ignore[return-value]

    def _group(self) -> None:
        # set by `build_attention_metadata`, the maker of every batch whose groups are read
        max_group_blocks, block_size, num_blocks, all_blocks = cast(_Grouping, self.grouping)
        groups, self._singles = _group_decodes(num_blocks, max_group_blocks)
        tables, start = [], 0
        for count in num_blocks:
            tables.append(all_blocks[start:start + count])
            start += count
        self._groups = [_padded_group(members, tables, self.context_lens, block_size,
                                      self.rows.device, whole=len(members) == len(num_blocks))
                        for members in groups]


# a chunk joins the decodes only in a context this short (each of its rows lists its
# blocks: rows x blocks table entries)
CHUNK_AS_DECODES_MAX_CONTEXT = 1024


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a layer's attention needs for one step; built once, read by every layer."""

    kv_cache: torch.Tensor  # [num_blocks, 2, num_layers, block_size, num_kv_heads, head_dim]
    slot_blocks: torch.Tensor  # [num_tokens] int64, block id of each new token's slot
    slot_offsets: torch.Tensor  # [num_tokens] int64, offset of that slot in its block
    chunks: list[PrefillChunk]
    decodes: DecodeBatch | None


def build_attention_metadata(
    kv_cache: torch.Tensor, spans: list[tuple[int, int, list[int]]],
    chunks_as_decodes: int = 0,
) -> AttentionMetadata:
    """Metadata for one step. `spans` holds, per sequence in flattened order,
    `(start_pos, num_tokens, block_table)`; block tables must cover the new tokens.

    `chunks_as_decodes`: a prompt chunk of at most this many tokens, in a context of at
    most `CHUNK_AS_DECODES_MAX_CONTEXT`, joins the decodes, one query per row (query i
    attends to the context up to its own position). A backend whose decode reads the
    cache in place (the native CPU one) then attends to a mixed step in one call per
    layer, where each chunk would cost an attention call and a gather of its own."""
    block_size = kv_cache.shape[3]
    dev = kv_cache.device
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    chunks: list[PrefillChunk] = []
    dec_rows: list[int] = []
    dec_blocks: list[int] = []
    dec_lens: list[int] = []
    dec_num_blocks: list[int] = []
    row = 0
    for start, n, table in spans:
        end = start + n
        table = table[: -(-end // block_size)]
        if n == 1:
            slot_blocks.append(table[start // block_size])
            slot_offsets.append(start % block_size)
            dec_rows.append(row)
            dec_num_blocks.append(len(table))
            dec_blocks.extend(table)
            dec_lens.append(end)
            row += 1
            continue
        for pos in range(start, end):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
        if n <= chunks_as_decodes and end <= CHUNK_AS_DECODES_MAX_CONTEXT:
            for pos in range(start, end):
                num_blocks = pos // block_size + 1
                dec_rows.append(row + pos - start)
                dec_num_blocks.append(num_blocks)
                dec_blocks.extend(table[:num_blocks])
                dec_lens.append(pos + 1)
        elif start == 0:
            last = chunks[-1] if chunks else None
            if (last is not None and last.block_table is None and last.num_tokens == n
                    and last.token_start + last.num_seqs * n == row):
                last.num_seqs += 1
            else:
                chunks.append(PrefillChunk(row, n, 0, None, None))
        else:
            keys = torch.arange(end, device=dev)
            queries = torch.arange(start, end, device=dev)
            mask = keys[None, :] <= queries[:, None]  # causal, aligned to the context's end
            table_t = torch.tensor(table, dtype=torch.int64, device=dev)
            chunks.append(PrefillChunk(row, n, start, table_t, mask))
        row += n
    decodes = None
    if dec_rows:
        block_bytes = block_size * kv_cache.shape[4] * kv_cache.shape[5] * kv_cache.element_size()
        max_group_blocks = (_MAX_GROUP_GATHER_BYTES_CPU // block_bytes if dev.type == "cpu"
                            else None)
        # one tensor for every table, split into views: one host-to-device copy
        all_tables = torch.tensor(dec_blocks, dtype=torch.int64, device=dev)
        decodes = DecodeBatch(
            rows=torch.tensor(dec_rows, dtype=torch.int64, device=dev),
            rows_are_all=len(dec_rows) == row,
            block_tables=list(all_tables.split(dec_num_blocks)),
            context_lens=dec_lens,
            all_tables=all_tables,
            grouping=(max_group_blocks, block_size, dec_num_blocks, dec_blocks),
        )
    return AttentionMetadata(
        kv_cache=kv_cache,
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.int64, device=dev),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.int64, device=dev),
        chunks=chunks,
        decodes=decodes,
    )


def _group_decodes(num_blocks: list[int], max_group_blocks: int | None
                   ) -> tuple[list[list[int]], list[int]]:
    """Split decodes (by their tables' lengths) into padded groups and singles.

    Sorted by length, a group grows while its padded slots stay within `_MAX_PADDING` of
    its real ones and its padded gather within `max_group_blocks` (None: no limit)."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    groups: list[list[int]] = []
    singles: list[int] = []
    current: list[int] = []
    real = 0
    for i in order + [-1]:
        n = num_blocks[i] if i >= 0 else 0
        grows = (i >= 0 and current
                 and (len(current) + 1) * n <= _MAX_PADDING * (real + n)
                 and (max_group_blocks is None or (len(current) + 1) * n <= max_group_blocks))
        if grows:
            current.append(i)
            real += n
            continue
        if len(current) > 1:
            groups.append(sorted(current))
        else:
            singles.extend(current)
        current, real = [i], n
    return groups, sorted(singles)


def _padded_group(members: list[int], tables: list[list[int]], lens: list[int],
                  block_size: int, dev: torch.device, whole: bool) -> DecodeGroup:
    max_blocks = max(len(tables[i]) for i in members)
    padded: list[int] = []
    for i in members:
        # padding repeats the sequence's own first block: finite values, masked out
        padded.extend(tables[i] + tables[i][:1] * (max_blocks - len(tables[i])))
    keys = torch.arange(max_blocks * block_size, device=dev)
    group_lens = torch.tensor([lens[i] for i in members], dtype=torch.int64, device=dev)
    return DecodeGroup(
        members=None if whole else torch.tensor(members, dtype=torch.int64, device=dev),
        tables=torch.tensor(padded, dtype=torch.int64, device=dev).view(len(members),
                                                                       max_blocks),
        mask=(keys[None, :] < group_lens[:, None])[:, None, None, :],
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into their slots of one layer's cache."""
    k_cache[slot_blocks, slot_offsets] = k
    v_cache[slot_blocks, slot_offsets] = v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    decode=None,
) -> torch.Tensor:
    """Attention of q [num_tokens, num_heads, head_dim] over each sequence's context.

    k, v [num_tokens, num_kv_heads, head_dim] are this step's new keys/values, already
    stored in the cache. Returns [num_tokens, num_heads * head_dim]. `decode`: a
    backend's function for the decodes, with `_decode`'s signature (default `_decode`).
    """
    num_tokens, num_heads, head_dim = q.shape
    decode = decode or _decode
    decodes = meta.decodes
    if decodes is not None and decodes.rows_are_all:
        return decode(q, k_cache, v_cache, decodes).view(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for chunk in meta.chunks:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_seqs * chunk.num_tokens)
        out[rows] = _chunk(q[rows], k[rows], v[rows], k_cache, v_cache, chunk).flatten(1)
    if decodes is not None:
        out[decodes.rows] = decode(q[decodes.rows], k_cache, v_cache, decodes).flatten(1)
    return out


def _chunk(q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
    """[num_seqs * n, num_heads, head_dim] attention of a chunk (of equal fresh prompts)."""
    if chunk.block_table is None:
        # fresh prompts: their keys are the ones just computed; plain causal attention,
        # one batched call for all of them
        n = chunk.num_tokens
        qh, kh, vh = (x.view(chunk.num_seqs, n, *x.shape[1:]).transpose(1, 2)
                      for x in (q, k, v))  # [num_seqs, heads, n, head_dim]
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(q.shape)
    # after a cached prefix: read the context back from the cache (exactly its length),
    # and align the causal mask to its end (query i sits at position start_pos + i)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
    context_len = chunk.start_pos + chunk.num_tokens
    kc = _gather(k_cache, chunk.block_table)[:context_len].transpose(0, 1).unsqueeze(0)
    vc = _gather(v_cache, chunk.block_table)[:context_len].transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(qh, kc, vc, attn_mask=chunk.mask, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _decode(q, k_cache, v_cache, decodes: DecodeBatch) -> torch.Tensor:
    """[num_decodes, num_heads, head_dim] attention of one new token per sequence."""
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # NOTE: every query of a decode sits at the same position, so the query heads sharing
    # a KV head form one [group, head_dim] matrix against that head's keys: no KV
    # repetition for GQA, and one matmul per sequence instead of one per head.
    qh = (q * head_dim**-0.5).view(num_decodes, num_kv_heads, num_heads // num_kv_heads,
                                   head_dim)
    groups = decodes.groups
    if len(groups) == 1 and groups[0].members is None:
        return _decode_group(qh, k_cache, v_cache, groups[0]).view(q.shape)
    out = q.new_empty(qh.shape)
    for group in groups:
        out[group.members] = _decode_group(qh[group.members], k_cache, v_cache, group)
    if not decodes.singles:
        return out.view(q.shape)
    # NOTE: on CPU a single sequence's small bf16 matmuls cost ~100 us each in oneDNN
    # (and, 2-threaded, wait for both cores), their fp32 form a few us (Xeon, bf16 batch
    # 1: 16.1 vs 16.8 ms per step at best, 19 vs 98 ms median with the cores shared)
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    qc = qh.to(compute)
    # NOTE: per sequence, gather then use at once: the copy (at most a few hundred KB) is
    # still in cache when the matmul reads it, where one flat gather of every sequence's
    # blocks goes to memory and back. And a plain matmul/softmax/matmul beats SDPA here:
    # with a few queries per KV head its flash kernel's blocking costs more than it saves.
    for i in decodes.singles:
        length = decodes.context_lens[i]
        kc = _gather(k_cache, decodes.block_tables[i])[:length].to(compute).transpose(0, 1)
        vc = _gather(v_cache, decodes.block_tables[i])[:length].to(compute).transpose(0, 1)
        # the scores and probabilities are rounded to the cache's dtype as its own
        # matmuls would round them: only the speed changes
        scores = torch.matmul(qc[i], kc.transpose(1, 2)).to(q.dtype)  # [KVH, group, length]
        out[i] = torch.matmul(scores.softmax(-1).to(compute), vc)
    return out.view(q.shape)


def _decode_group(qh, k_cache, v_cache, group: DecodeGroup) -> torch.Tensor:
    """[n, num_kv_heads, group, head_dim] attention of a padded group's decodes: one
    batched gather and two batched matmuls instead of a loop of small ops."""
    num_decodes, num_kv_heads, _, head_dim = qh.shape
    num_padded = group.tables.shape[1] * k_cache.shape[1]
    kc = _gather(k_cache, group.tables.flatten())
    vc = _gather(v_cache, group.tables.flatten())
    kc = kc.view(num_decodes, num_padded, num_kv_heads, head_dim).transpose(1, 2)
    vc = vc.view(num_decodes, num_padded, num_kv_heads, head_dim)
    # NOTE: a padded slot's probability is 0, but 0 * NaN is NaN: zero the padded values
    # (the gather is a fresh copy), so whatever an unwritten slot holds never leaks in
    vc.masked_fill_(~group.mask.view(num_decodes, num_padded, 1, 1), 0)
    vc = vc.transpose(1, 2)
    scores = torch.matmul(qh, kc.transpose(2, 3))  # [n, KVH, group, padded]
    scores.masked_fill_(~group.mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), vc)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[len(block_ids) * block_size, num_kv_heads, head_dim] copy of the listed blocks.

    NOTE: a layer's view is strided across blocks but each block's slab is contiguous, so
    the view is handled as 2-D rows `[num_blocks, block_size * num_kv_heads * head_dim]`:
    `index_select` then copies whole rows (1.2-4x faster than on the 4-D view here, and
    faster than advanced indexing). `view`, not `reshape`: a layout without contiguous
    block slabs must fail loudly, not copy the whole cache on every call.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.view(num_blocks, block_size * num_kv_heads * head_dim)
    return rows.index_select(0, block_ids).view(-1, num_kv_heads, head_dim)

"""Llama decoder (also the body of Qwen2 and Qwen3, which differ in small options).

Reads like the Hugging Face reference; the only paged-cache detail is that attention
hands its new K/V and the step's `AttentionMetadata` to the kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import ClassVar, cast

import torch
from torch import nn

import kernels
from kernels import native
from kernels.attention import AttentionMetadata
from kernels.rotary import rope_cos_sin_cache, rope_inv_freq
from workers.engine.errors import StepInterrupted
from workers.engine.models.config import ModelConfig
from workers.engine.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
    native_rows,
)

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to max_position_embeddings, looked up per token."""

    # a buffer registered in `__init__` (declared for the type checker only)
    cos_sin: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        cache = rope_cos_sin_cache(inv_freq, config.max_position_embeddings)
        self.register_buffer("cos_sin", cache, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        cos, sin = self.cos_sin[positions].to(dtype).chunk(2, dim=-1)
        return cos, sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = config.num_kv_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
            bias=config.attention_bias, tp_size=tp_size, tp_rank=tp_rank,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size,
            bias=False, tp_size=tp_size, tp_rank=tp_rank,
        )
        # both set or both None
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # (set together)
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = kernels.apply_rotary(q, k, cos, sin)
        k_cache = meta.kv_cache[:, 0, self.layer_idx]
        v_cache = meta.kv_cache[:, 1, self.layer_idx]
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
        o = kernels.paged_attention(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(o)


# An fp32 prompt step's MLP on the CPU runs in chunks of this many rows: the gated
# activation's input (rows x 2 x intermediate size: 32 MB at 2,048 rows of the 100m model)
# then stays in the caches between the two products. 2,048 rows, 100m shapes, oneDNN
# prepacked, Xeon with AMX, 2 threads: 69.2 -> 61.5-61.9 ms at 256-512 rows a chunk, the
# same bits. Not in bf16: AMX's products lose more on smaller calls (10.3 -> 13.3 ms).
MLP_CHUNK_ROWS = 512


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=config.mlp_bias,
            tp_size=tp_size, tp_rank=tp_rank,
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=config.mlp_bias, tp_size=tp_size, tp_rank=tp_rank
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (rows <= 2 * MLP_CHUNK_ROWS or x.dtype != torch.float32 or not x.is_cpu
                or self.down_proj.tp_size != 1):
            return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))
        return torch.cat([self.down_proj(kernels.silu_and_mul(self.gate_up_proj(
            x[start:start + MLP_CHUNK_ROWS]))) for start in range(0, rows, MLP_CHUNK_ROWS)])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, tp_size, tp_rank)
        self.mlp = LlamaMLP(config, tp_size, tp_rank)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, cos, sin, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_size, tp_rank
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp_size, tp_rank) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    # decode steps it takes run every layer as one native call (`use_native_decoder`)
    native_decoder: native.NativeDecoder | None = None
    # asked before each layer of the layer loop: True stops the step (set_yield_check)
    yield_check: Callable[[int], bool] | None = None
    # this step's (flag, layers) the native decoder reads between layers, or None
    decoder_stop: Callable[[], tuple[native.StopFlag, int] | None] | None = None

    def use_native_decoder(self, max_rows: int) -> int:
        """Run decode steps of up to `max_rows` rows as one native call over all layers
        (kernels.native.NativeDecoder), fewer where a projection sends such calls to
        another path than the native kernel; returns the rows it takes (0: none, and the
        layer loop stays). Call once the linear plan is applied."""
        self.native_decoder = None
        rows = max_rows
        layers: list[dict[str, torch.Tensor | None]] = []
        # (the layers' type: a ModuleList's items are typed nn.Module)
        eps = {cast(LlamaDecoderLayer, self.layers[0]).input_layernorm.eps}
        panels: set[bool] = set()
        for layer in cast(Iterable[LlamaDecoderLayer], self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            # the row-parallel layers add a bias after the product, rounded apart
            if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
                return 0
            if any(p.tp_size != 1 for p in projections):
                return 0
            rows = min(rows, *(native_rows(p) for p in projections))
            panels.update(p.panel_weight is not None for p in projections)
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if attn.q_norm is not None:
                norms += [attn.q_norm, cast(RMSNorm, attn.k_norm)]  # set with q_norm
            eps.update(n.eps for n in norms)
            weight = {p: p.weight if p.panel_weight is None else p.panel_weight
                      for p in projections}
            layers.append({
                "input_norm": layer.input_layernorm.weight, "qkv": weight[attn.qkv_proj],
                "qkv_bias": attn.qkv_proj.bias,
                "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
                "k_norm": None if attn.k_norm is None else attn.k_norm.weight,
                "o": weight[attn.o_proj], "post_norm": layer.post_attention_layernorm.weight,
                "gate_up": weight[mlp.gate_up_proj], "gate_up_bias": mlp.gate_up_proj.bias,
                "down": weight[mlp.down_proj]})
        # every projection on its panels, or none (the decoder takes one layout)
        if rows < 1 or len(eps) != 1 or len(panels) != 1:
            return 0
        attn = cast(LlamaDecoderLayer, self.layers[0]).self_attn
        try:
            self.native_decoder = native.NativeDecoder(
                layers, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim, eps=eps.pop(), max_rows=rows, panels=panels.pop())
        except (ValueError, RuntimeError) as exc:  # a dtype or layout it does not take
            logger.warning("native decoder not used: %s", exc)
            return 0
        return rows

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        decoder = self.native_decoder
        if decoder is not None and decoder.takes(hidden, meta):
            check = self.yield_check
            if check is not None and check(0):
                raise StepInterrupted(f"stopped before layer 0 of {len(self.layers)}")
            stop = self.decoder_stop() if self.decoder_stop is not None else None
            try:
                hidden, residual = decoder(hidden, cos, sin, meta, *(stop or ()))
            except native.DecoderStopped as exc:
                raise StepInterrupted(
                    f"stopped before layer {exc.layer} of {len(self.layers)}") from None
        else:
            residual = None
            check = self.yield_check
            for index, layer in enumerate(self.layers):
                if check is not None and check(index):
                    raise StepInterrupted(f"stopped before layer {index} of {len(self.layers)}")
                hidden, residual = layer(hidden, residual, cos, sin, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our merged parameter, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp_size, tp_rank)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_size, tp_rank)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, attn_metadata)

    def use_native_decoder(self, max_rows: int) -> int:
        """See `LlamaModel.use_native_decoder`."""
        return self.model.use_native_decoder(max_rows)

    def set_yield_check(self, check: Callable[[int], bool] | None,
                        decoder_stop: Callable[[], tuple[native.StopFlag, int] | None]
                        | None = None) -> None:
        """`check(layer_index)` before each layer of the next forwards (None: never); True
        stops the step there with `StepInterrupted`. The native decoder's whole-step call
        asks `check(0)` before it starts, and reads the flag `decoder_stop()` returns for
        the step (None: none) before each of its first layers, without the GIL."""
        self.model.yield_check = check
        self.model.decoder_stop = decoder_stop

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size]."""
        return self.lm_head.compute_logits(hidden).float()

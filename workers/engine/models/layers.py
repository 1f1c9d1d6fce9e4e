"""Linear and embedding layers written for a tensor-parallel split.

Each layer holds only its rank's shard (`tp_size`, `tp_rank`; 1 and 0 today) and each
parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that cuts the full
checkpoint tensor down to that shard. The collective a split needs sits at the marked
place in `forward` (all-reduce after a row-parallel matmul, all-gather of logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels import linear as dense
from kernels import native


class ShapeMismatch(ValueError):
    """A checkpoint tensor does not have the shape the layer expects."""


def _check(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ShapeMismatch(f"expected shape {tuple(param.shape)}, found {tuple(loaded.shape)}")


def _shard(loaded: torch.Tensor, dim: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    if tp_size == 1:
        return loaded
    if loaded.shape[dim] % tp_size:
        raise ShapeMismatch(f"dim {dim} of {tuple(loaded.shape)} does not split {tp_size} ways")
    size = loaded.shape[dim] // tp_size
    return loaded.narrow(dim, tp_rank * size, size)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Replicated parameter (norm gains): copy as is."""
    _check(param, loaded)
    param.data.copy_(loaded)


def _attach(param: nn.Parameter, loader: Callable) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class LinearBase(nn.Module):
    # set by `_no_panels`, the panels as a buffer (declared for the type checker only: a
    # class value would clash with `register_buffer`)
    panel_weight: torch.Tensor | None
    panel_features: int

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.weight = _attach(nn.Parameter(torch.empty(out_features, in_features),
                                           requires_grad=False), self.weight_loader)
        self.bias = None
        if bias:
            self.bias = _attach(nn.Parameter(torch.empty(out_features), requires_grad=False),
                                self.weight_loader)
        _no_panels(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        raise NotImplementedError

    # with `plain_rows` set (a split), a prepacked copy beside the plain weight: calls of
    # at most `plain_rows` rows take the plain one, larger ones the copy
    packed_weight: torch.Tensor | None = None
    plain_rows = 0
    # calls of at most this many rows on the plain weight take the native kernel
    skinny_rows = 0

    def pack_panels(self) -> bool:
        """See `_pack_panels`."""
        return _pack_panels(self)

    def prepack(self, plain_rows: int | None = None, widen: bool = False) -> bool:
        """Swap the loaded weight for its prepacked copy (CPU; kernels/linear.py), or with
        `plain_rows` keep both (a split); True if it did. `widen`: a bf16 weight on a CPU
        without bf16 dot products gets an fp32 copy (`dense.can_prepack_widened`). The
        layer can compute afterwards, not load weights or move."""
        if self.packed_weight is not None or not dense.can_prepack_any(self.weight, widen):
            return False
        packed = dense.prepack(self.weight)
        if plain_rows is not None:
            self.packed_weight, self.plain_rows = packed, plain_rows
            return True
        _replace_weight(self, packed)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _project(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        if out_features % tp_size:
            raise ValueError(f"{out_features} output features do not split {tp_size} ways")
        super().__init__(in_features, out_features // tp_size, bias, tp_size, tp_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = _shard(loaded, 0, self.tp_size, self.tp_rank)
        _check(param, shard)
        param.data.copy_(shard)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate + up).

    Checkpoint tensor `shard_id` i fills rows [sum(sizes[:i]), sum(sizes[:i+1])) / tp_size.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp_size, tp_rank)

    def _rows(self, shard_id: int | str) -> tuple[int, int]:
        # a merged projection's parts are numbered (QKVParallelLinear's override: named)
        index = cast(int, shard_id)
        offset = sum(self.output_sizes[:index]) // self.tp_size
        return offset, self.output_sizes[index] // self.tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id is None:
            raise ValueError("a merged projection loads one part at a time: pass shard_id")
        offset, size = self._rows(shard_id)
        target = param.data.narrow(0, offset, size)
        shard = _shard(loaded, 0, self.tp_size, self.tp_rank)
        _check(target, shard)
        target.copy_(shard)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; heads split across ranks (shard ids q, k, v)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_size: int = 1, tp_rank: int = 0) -> None:
        if num_heads % tp_size or num_kv_heads % tp_size:
            raise ValueError(
                f"tensor parallel size {tp_size} must divide the {num_heads} attention heads "
                f"and the {num_kv_heads} KV heads"
            )
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, tp_size, tp_rank)

    def _rows(self, shard_id: int | str) -> tuple[int, int]:
        # keyed by any shard id for the type checker: a number is a KeyError
        parts: dict[int | str, int] = {"q": 0, "k": 1, "v": 2}
        return super()._rows(parts[shard_id])


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed (all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        if in_features % tp_size:
            raise ValueError(f"{in_features} input features do not split {tp_size} ways")
        super().__init__(in_features // tp_size, out_features, bias, tp_size, tp_rank)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # the bias is added once, after the reduction: every rank keeps all of it
        shard = _shard(loaded, 1, self.tp_size, self.tp_rank) if loaded.dim() == 2 else loaded
        _check(param, shard)
        param.data.copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _project(self, x, None)
        if self.tp_size > 1:
            dist.all_reduce(y)  # TP: sum the partial products of every rank
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks."""

    # a buffer registered in `__init__` (declared for the type checker only)
    lookup_panels: torch.Tensor | None

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        if vocab_size % tp_size:
            raise ValueError(f"vocab size {vocab_size} does not split {tp_size} ways")
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.num_local = vocab_size // tp_size
        self.vocab_start = tp_rank * self.num_local
        self.weight = _attach(nn.Parameter(torch.empty(self.num_local, hidden_size),
                                           requires_grad=False), self.weight_loader)
        # the tied LM head's panels, once lookups read them and the plain weight is gone
        # (`look_up_in_panels`); a buffer, so that it moves with them (into huge pages)
        self.register_buffer("lookup_panels", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = _shard(loaded, 0, self.tp_size, self.tp_rank)
        _check(param, shard)
        param.data.copy_(shard)

    def look_up_in_panels(self, panels: torch.Tensor) -> None:
        """Read rows from `panels` (`native.pack_panels` of this weight: the tied LM
        head's) and free the plain weight, which the head no longer reads either. Lookups
        then copy the same values from a strided layout: a prompt of 2,048 tokens of a
        1,024-wide model takes ~25 ms instead of 5, a decode step's rows well under a
        millisecond. One rank only (no vocabulary split)."""
        if self.tp_size != 1:
            raise ValueError("panels hold a whole vocabulary: one rank only")
        self.lookup_panels = panels
        del self.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.lookup_panels is not None:
            return native.panel_rows(self.lookup_panels, input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        dist.all_reduce(y)  # TP: each token's row lives on exactly one rank
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; each rank computes its slice of the logits."""

    packed_weight: torch.Tensor | None = None
    plain_rows = 0  # calls of at most this many rows take the plain weight (a split)
    skinny_rows = 0  # calls of at most this many rows take the native kernel
    # as for `LinearBase` (`_no_panels`; declared for the type checker only)
    panel_weight: torch.Tensor | None
    panel_features: int

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _no_panels(self)

    def pack_panels(self) -> bool:
        """See `_pack_panels` (the plain weight stays, as for `prepack`)."""
        return _pack_panels(self)

    def prepack(self, plain_rows: int | None = None, widen: bool = False) -> bool:
        """Keep a prepacked copy of the projection beside the weight (CPU); True if it
        made one. `plain_rows`, `widen`: as for `LinearBase.prepack`.

        NOTE: the weight stays: tied to the input embedding it must stay row-major for
        lookups (until `drop_unused_plain_weights` moves those to the panels). The copy
        costs vocab x hidden elements and gives the largest single GEMM of a decode step
        (the logits) the faster kernel (docs/benchmarks.md, CPU speed)."""
        if self.packed_weight is not None or not dense.can_prepack_any(self.weight, widen):
            return False
        self.packed_weight = dense.prepack(self.weight)
        self.plain_rows = plain_rows or 0
        return True

    def drop_plain_weight(self) -> bool:
        """Free the plain weight once no call reaches it: the panels take the native
        kernel's rows and the prepacked copy every call above them. The caller checks no
        other module reads the weight (a tied input embedding looks up in the panels
        first). True if it did."""
        if self.panel_weight is None or self.packed_weight is None \
                or self.plain_rows > self.skinny_rows:
            return False
        packed, self.packed_weight = self.packed_weight, None
        _replace_weight(self, packed)
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = _project(self, hidden, None)
        if self.tp_size > 1:  # TP: gather the vocabulary slices of every rank
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits


def _replace_weight(layer: LinearBase | ParallelLMHead, packed: torch.Tensor) -> None:
    """The plain weight is freed: its prepacked copy takes its place (a buffer: a packed
    tensor is no Parameter)."""
    del layer.weight
    layer.register_buffer("weight", packed, persistent=False)


def _no_panels(layer: LinearBase | ParallelLMHead) -> None:
    # fp32: the weight packed in panels for the native kernel (`_pack_panels`), a buffer
    # so that it moves with the module (into huge pages); None until packed
    layer.register_buffer("panel_weight", None, persistent=False)
    layer.panel_features = 0  # the weight's rows, which the panels pad to their width


def _pack_panels(layer: LinearBase | ParallelLMHead) -> bool:
    """Keep the weight packed in panels (kernels/native.py `pack_panels`): the native
    kernel's calls (of at most `skinny_rows` rows) take them instead of the plain weight.
    True if it packed; only an fp32 plain weight where `native.panels_supported`."""
    if layer.panel_weight is not None or not native.panels_supported(layer.weight):
        return False
    layer.panel_weight = native.pack_panels(layer.weight)
    layer.panel_features = layer.weight.shape[0]
    return True


def _project(layer: LinearBase | ParallelLMHead, x: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + bias` on the path this call's row count takes: the native kernel up to
    `skinny_rows` rows on the panels where the weight has them, the prepacked copy above
    `plain_rows` rows (a split), else the plain weight (the native kernel up to
    `skinny_rows` rows)."""
    if layer.panel_weight is not None and x.shape[0] <= layer.skinny_rows:
        return native.panel_linear(x, layer.panel_weight, layer.panel_features, bias)
    if layer.packed_weight is not None and x.shape[0] > layer.plain_rows:
        return dense.linear(x, layer.packed_weight, bias)
    return dense.linear(x, layer.weight, bias, layer.skinny_rows)


def native_rows(layer: LinearBase | ParallelLMHead) -> int:
    """Calls of at most this many rows reach the native kernel on `_project`'s path (the
    panels first; then a split's prepacked copy is asked first; a weight swapped for its
    packed copy takes none)."""
    if layer.panel_weight is not None:
        return layer.skinny_rows
    if layer.weight.is_mkldnn:
        return 0
    if layer.packed_weight is not None:
        return min(layer.skinny_rows, layer.plain_rows)
    return layer.skinny_rows


def use_native_kernel(model: nn.Module, skinny_rows: int) -> int:
    """Give every projection of `model` whose weight the native kernel takes (its panels,
    or the plain weight; kernels/native.py) the calls of at most `skinny_rows` rows;
    returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase | ParallelLMHead) and (
                module.panel_weight is not None or native.supports(module.weight)):
            module.skinny_rows = skinny_rows
            count += 1
    return count


def pack_panels(model: nn.Module) -> int:
    """Pack every projection weight of `model` that `native.panels_supported` in panels
    for the native kernel (`_pack_panels`); returns how many. Before `prepack_linears`
    frees a plain weight."""
    return sum(module.pack_panels() for module in model.modules()
               if isinstance(module, LinearBase | ParallelLMHead))


def prepack_linears(model: nn.Module, plain_rows: int | None = None,
                    widen: bool = False) -> int:
    """Prepack the weight of every linear layer and LM head of `model` that can take the
    CPU's prepacked path; returns how many did. With `plain_rows`, keep the plain weights
    too and give them the calls of at most that many rows (a split); with `widen`, bf16
    weights on a CPU without bf16 dot products get fp32 copies. Call once the weights are
    loaded and on their device; calling again changes nothing."""
    return sum(module.prepack(plain_rows, widen) for module in model.modules()
               if isinstance(module, LinearBase | ParallelLMHead))


def drop_unused_plain_weights(model: nn.Module) -> int:
    """Free the plain weight of every LM head of `model` that its panels and prepacked
    copy serve alone (`ParallelLMHead.drop_plain_weight`); returns how many. A head tied
    to the input embedding frees it too when that embedding is the only other module
    reading it and holds the whole vocabulary: its lookups then read the head's panels
    (`VocabParallelEmbedding.look_up_in_panels`), so the weight is held twice (panels,
    prepacked), not three times. (A linear layer's plain weight goes in `prepack`.)"""
    readers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            readers.setdefault(id(weight), []).append(module)
    dropped = 0
    for head in [m for m in model.modules() if isinstance(m, ParallelLMHead)]:
        weight = head._parameters.get("weight")
        others = [m for m in readers.get(id(weight), []) if m is not head]
        tied = [m for m in others if type(m) is VocabParallelEmbedding and m.tp_size == 1]
        if weight is None or len(tied) != len(others) or len(tied) > 1:
            continue
        if head.drop_plain_weight():
            for embedding in tied:  # (a head that dropped its weight has panels)
                embedding.look_up_in_panels(cast(torch.Tensor, head.panel_weight))
            dropped += 1
    return dropped


# bytes of projection weights the start-up timing of the linear paths streams per pass
PROBE_MAX_BYTES = 512 << 20


def probe_panels(model: nn.Module, max_bytes: int = PROBE_MAX_BYTES
                 ) -> list[tuple[torch.Tensor, int]]:
    """(panels, out_features) of the projections of `model` packed in panels, in model
    order up to `max_bytes`: what a start-up timing of one-row calls on panels streams."""
    chosen: list[tuple[torch.Tensor, int]] = []
    total = 0
    for module in model.modules():
        if not isinstance(module, LinearBase | ParallelLMHead) or module.panel_weight is None:
            continue
        size = module.panel_weight.numel() * module.panel_weight.element_size()
        if chosen and total + size > max_bytes:
            break
        chosen.append((module.panel_weight, module.panel_features))
        total += size
    return chosen


def probe_weights(model: nn.Module, max_bytes: int = PROBE_MAX_BYTES, *,
                  beside_packed: bool = False) -> list[torch.Tensor]:
    """The plain projection weights a start-up timing of the linear paths runs over: every
    layer's in model order (the LM head included) up to `max_bytes`, and at least one of
    each distinct shape. Empty once the weights are prepacked, unless `beside_packed`:
    then also the plain weights a split plan keeps beside their packed copies.

    NOTE: a pass must stream weights as a decode step does. One weight per shape stays in
    the cache from round to round and misjudges the row counts that read memory: on a
    Xeon without AMX, in fp32, that probe found oneDNN's path as fast at one row (0.96)
    while a step ran 14% faster on torch's `linear`."""
    chosen: list[torch.Tensor] = []
    shapes: set[tuple[int, ...]] = set()
    total = 0
    for module in model.modules():
        if not isinstance(module, LinearBase | ParallelLMHead) or module.weight.is_mkldnn \
                or (module.packed_weight is not None and not beside_packed):
            continue
        weight = module.weight
        size = weight.numel() * weight.element_size()
        if tuple(weight.shape) in shapes and total + size > max_bytes:
            continue
        chosen.append(weight)
        shapes.add(tuple(weight.shape))
        total += size
    return chosen

"""Load a Hugging Face checkpoint directory into our model modules, offline.

Reads `config.json`, the `*.safetensors` weights (one file, or shards listed in
`model.safetensors.index.json`) straight into our layers through each parameter's
`weight_loader`, and the tokenizer/chat template through `transformers`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kernels.cpu import has_native_bf16
from workers.engine.device import resolve_device
from workers.engine.fingerprint import fingerprint_files
from workers.engine.models.config import ModelConfig
from workers.engine.models.layers import ShapeMismatch
from workers.engine.models.registry import MODEL_REGISTRY, resolve_architecture

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# NOTE: the process-wide meaning of dtype="auto" when set to a dtype: the worker's settings
# read the same variable, so one export (the test suite pins float32) covers the served
# engine, the offline `LLM` and a bare `load_checkpoint`
DTYPE_ENV = "LLMQ_DTYPE"


@dataclass(slots=True)
class LoadedCheckpoint:
    config: ModelConfig
    model: nn.Module  # our module, weights loaded, eval mode, on the target device
    tokenizer: Any  # transformers tokenizer (offline)
    eos_token_ids: list[int]
    chat_template: str | None
    max_model_len: int
    fingerprint: str  # 16 hex chars: weights identity and dtype, equal across processes
    tp_size: int = 1  # tensor-parallel ranks the model is split over
    tp_rank: int = 0  # this process's shard (it holds only its slice of each split layer)


class CheckpointError(ValueError):
    """The checkpoint directory cannot be served; the message names the file and problem."""


def load_checkpoint(model_dir: str | Path, dtype: str = "auto",
                    device: str | torch.device = "cpu", *, tp_size: int = 1, tp_rank: int = 0,
                    with_tokenizer: bool = True) -> LoadedCheckpoint:
    """Load `model_dir` with weights in `dtype` on `device` ("auto": see `auto_dtype`).

    With `tp_size > 1` the model holds only shard `tp_rank` of each split layer (the
    weight loaders cut every checkpoint tensor down to it). A TP rank that is not the
    driver needs no tokenizer (`with_tokenizer=False`).
    """
    root = Path(model_dir)
    hf = _read_config(root)
    arch = _resolve(root, hf)
    torch_dtype = _resolve_dtype(hf, dtype, resolve_device(device).type)
    config = ModelConfig.from_hf(hf, arch, torch_dtype)
    files = _weight_files(root)

    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        model = MODEL_REGISTRY[arch](config, tp_size, tp_rank)  # type: ignore[call-arg]
    finally:
        torch.set_default_dtype(default_dtype)
    _load_weights(model, files, config)
    # the rotary table stays float32 (positions need its precision); it is cast per step
    model = model.to(device=resolve_device(device)).eval()

    tokenizer = _load_tokenizer(root) if with_tokenizer else None
    loaded = LoadedCheckpoint(
        config=config,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(root, hf, tokenizer),
        chat_template=getattr(tokenizer, "chat_template", None) if tokenizer else None,
        max_model_len=config.max_position_embeddings,
        fingerprint=checkpoint_fingerprint(root, torch_dtype),
        tp_size=tp_size,
        tp_rank=tp_rank,
    )
    logger.info("loaded %s (%s, %s, tp rank %d/%d) from %s, fingerprint %s", arch, torch_dtype,
                device, tp_rank, tp_size, root, loaded.fingerprint)
    return loaded


def _read_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a model directory needs a config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def _resolve(root: Path, hf: dict[str, Any]) -> str:
    try:
        return resolve_architecture(hf.get("architectures"), hf.get("model_type"))
    except ValueError as exc:
        raise CheckpointError(f"{root / 'config.json'}: {exc}") from exc


def auto_dtype(checkpoint_dtype: str, device_type: str, env: str | None = None,
               native_bf16: bool | None = None) -> str:
    """What dtype="auto" loads: `env` (LLMQ_DTYPE) when it names a dtype; on CPU bfloat16
    where the CPU does bf16 in hardware (half the weight bytes per step, and its bf16
    GEMMs beat fp32 ones there) and float32 elsewhere (emulated bf16 is slower and fp16
    has no fast CPU path); on an accelerator the checkpoint's dtype."""
    if env and env != "auto":
        return env
    if device_type == "cpu":
        native = has_native_bf16() if native_bf16 is None else native_bf16
        return "bfloat16" if native else "float32"
    return checkpoint_dtype


def _resolve_dtype(hf: dict[str, Any], dtype: str, device_type: str) -> torch.dtype:
    if dtype == "auto":
        stored = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
        dtype = auto_dtype(stored, device_type, os.environ.get(DTYPE_ENV))
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use auto or {', '.join(DTYPES)}"
                              f" (from dtype=... or {DTYPE_ENV})")
    return DTYPES[dtype]


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [root / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise CheckpointError(f"{index}: lists {path.name}, which is missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors weights (only safetensors load)")
    return files


def _load_weights(model: nn.Module, files: list[Path], config: ModelConfig) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    expected: set[tuple[str, Any]] = set()
    for name in params:
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        shard_ids = [sid for ckpt, (ours, sid) in packed.items() if f".{ours}." in name]
        if shard_ids:
            expected.update((name, sid) for sid in shard_ids)
        else:
            expected.add((name, None))
    loaded: set[tuple[str, Any]] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if ckpt_name.endswith("rotary_emb.inv_freq"):
                    continue  # derived from the config, never a weight
                if config.tie_word_embeddings and ckpt_name == "lm_head.weight":
                    continue  # tied: the embedding is the output projection
                name, shard_id = ckpt_name, None
                for ckpt_part, (ours, sid) in packed.items():
                    if f".{ckpt_part}." in ckpt_name:
                        name, shard_id = ckpt_name.replace(ckpt_part, ours), sid
                        break
                param = params.get(name)
                if param is None:
                    raise CheckpointError(
                        f"{path.name}: unexpected tensor {ckpt_name!r}; "
                        f"{config.arch} has no parameter for it"
                    )
                tensor = f.get_tensor(ckpt_name).to(param.dtype)
                loader = param.weight_loader  # type: ignore[attr-defined]
                try:
                    loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
                except ShapeMismatch as exc:
                    raise CheckpointError(f"{path.name}: tensor {ckpt_name!r}: {exc}") from exc
                loaded.add((name, shard_id))
    missing = expected - loaded
    if missing:
        names = sorted(_ckpt_name(n, sid, packed) for n, sid in missing)
        raise CheckpointError(
            f"{files[0].parent}: missing tensor(s) {', '.join(names[:5])}"
            f"{' ...' if len(names) > 5 else ''} in {', '.join(p.name for p in files)}"
        )


def _ckpt_name(name: str, shard_id: Any, packed: dict[str, tuple[str, Any]]) -> str:
    for ckpt_part, (ours, sid) in packed.items():
        if shard_id is not None and sid == shard_id and f".{ours}." in name:
            return name.replace(ours, ckpt_part)
    return name


def _load_tokenizer(root: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:
        raise CheckpointError(f"{root}: cannot load the tokenizer ({exc})") from exc


def _eos_token_ids(root: Path, hf: dict[str, Any], tokenizer: Any) -> list[int]:
    gen = root / "generation_config.json"
    candidates = []
    if gen.is_file():
        candidates.append(json.loads(gen.read_text()).get("eos_token_id"))
    candidates.append(hf.get("eos_token_id"))
    candidates.append(getattr(tokenizer, "eos_token_id", None))
    for value in candidates:
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if ids:
            return [int(i) for i in ids]
    return []


def checkpoint_fingerprint(root: Path, dtype: torch.dtype) -> str:
    """The KV-sharing identity of the checkpoint in `root` served in `dtype`: every byte of
    its weights (workers/engine/fingerprint.py), stable across processes."""
    return fingerprint_files(root / "config.json", _weight_files(root), str(dtype))

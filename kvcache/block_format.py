"""The blob of one KV block in a tier: a fixed header, then the block's payload bytes.

The payload is the block's slab of the runner's KV tensor, all layers, K and V: shape
`[2, num_layers, block_size, num_kv_heads, head_dim]` of `dtype`, C order. The header says
what the payload is, so a blob written by another model, dtype, block size or TP layout, or
torn or flipped on the way, is refused (a miss) instead of being read as KV.

Header (little-endian, HEADER_SIZE bytes, version 1):

    magic      4s    b"LQKV"
    version    u16   FORMAT_VERSION
    reserved   u16   0
    fingerprint 32s  ASCII, NUL-padded (make_fingerprint)
    dtype      16s   ASCII, NUL-padded ("bfloat16", "float32", ...)
    block_size u32   tokens per block
    ndim       u8    number of dims of the slab shape (<= MAX_NDIM), 3 pad bytes
    shape      8*u32 the slab shape, unused dims 0
    length     u64   payload bytes
    crc32      u32   zlib.crc32 of the payload
    reserved   4 bytes 0 (pads the header to a multiple of 16)
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
import zlib
from dataclasses import dataclass

from kvcache.hashing import BlockHash

logger = logging.getLogger(__name__)

MAGIC = b"LQKV"
FORMAT_VERSION = 1
MAX_NDIM = 8
_HEADER = struct.Struct(f"<4sHH32s16sIB3x{MAX_NDIM}IQI4x")
HEADER_SIZE = _HEADER.size  # 112

# Bytes per element of the dtypes a KV cache may hold (torch names without "torch.").
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "int8": 1, "uint8": 1,
}


def normalize_dtype(dtype: object) -> str:
    """"bfloat16" for torch.bfloat16, "torch.bfloat16" or "bfloat16"."""
    name = str(dtype)
    return name.removeprefix("torch.")


def make_fingerprint(model_fingerprint: str, dtype: str, block_size: int, tp_size: int,
                     tp_rank: int) -> str:
    """16 hex digits naming one KV layout: weights, KV dtype, block size, TP size and rank.

    Blocks are shared only between workers whose fingerprints are equal, i.e. whose KV
    bytes for the same tokens are interchangeable (each TP rank holds its own heads).
    """
    if block_size < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need block_size >= 1 and 0 <= tp_rank < tp_size, got block_size="
                         f"{block_size}, tp_size={tp_size}, tp_rank={tp_rank}")
    text = (f"llmq.kv.v1|{model_fingerprint}|{normalize_dtype(dtype)}|{block_size}"
            f"|tp{tp_size}.{tp_rank}")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def block_key(fingerprint: str, block_hash: BlockHash) -> str:
    """The key of a block in every tier; Redis stores it as `<prefix>:kv:<fp>:<hash hex>`."""
    return f"kv:{fingerprint}:{block_hash.hex()}"


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What every blob of one KV cache layout must say about itself."""

    fingerprint: str  # make_fingerprint(...): weights, dtype, block size, TP layout
    dtype: str  # element type of the payload, e.g. "bfloat16"
    block_size: int  # tokens per block
    shape: tuple[int, ...]  # [2, num_layers, block_size, num_kv_heads, head_dim] per block

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.fingerprint.isascii() or not 0 < len(self.fingerprint) <= 32:
            raise ValueError(f"fingerprint must be 1-32 ASCII characters, got "
                             f"{self.fingerprint!r}; use make_fingerprint")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KV dtype {self.dtype!r} has no blob format; known: "
                             f"{', '.join(sorted(DTYPE_SIZES))}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 < len(self.shape) <= MAX_NDIM or min(self.shape) < 1:
            raise ValueError(f"shape must have 1-{MAX_NDIM} positive dims, got {self.shape}")

    @property
    def num_bytes(self) -> int:
        """Payload bytes of one block (the runner's `bytes_per_block`)."""
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def encode_block(payload: bytes, meta: BlockMeta) -> bytes:
    """Header + payload as one contiguous blob. Raises ValueError if the length is wrong."""
    if len(payload) != meta.num_bytes:
        raise ValueError(f"a block of shape {meta.shape} {meta.dtype} has {meta.num_bytes} "
                         f"bytes, got a {len(payload)}-byte payload")
    shape = meta.shape + (0,) * (MAX_NDIM - len(meta.shape))
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, meta.fingerprint.encode("ascii"), meta.dtype.encode("ascii"),
        meta.block_size, len(meta.shape), *shape, len(payload), zlib.crc32(payload),
    )
    return header + payload


def decode_block(blob: bytes, expected: BlockMeta) -> bytes | None:
    """The payload of `blob` if its header matches `expected` and its checksum holds.

    None for anything wrong (truncated, wrong magic, version, fingerprint, dtype, block
    size, shape, length or checksum); each reason is logged once per process at WARNING.
    """
    reason = _header_problem(blob, expected)
    if reason is None:
        payload = blob[HEADER_SIZE:]
        if zlib.crc32(payload) == _HEADER.unpack_from(blob)[-1]:
            return payload
        reason = "checksum mismatch (corrupted payload)"
    with _logged_lock:
        first = reason not in _logged_reasons
        _logged_reasons.add(reason)
    if first:
        logger.warning("refusing a KV block blob: %s; treated as a miss (logged once per "
                       "reason)", reason)
    return None


def _header_problem(blob: bytes, expected: BlockMeta) -> str | None:
    if len(blob) < HEADER_SIZE:
        return "truncated header"
    (magic, version, _, fingerprint, dtype, block_size, ndim, *rest) = _HEADER.unpack_from(blob)
    shape, length = rest[:MAX_NDIM], rest[MAX_NDIM]
    if magic != MAGIC:
        return "wrong magic (not a KV block blob)"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    if fingerprint.rstrip(b"\0") != expected.fingerprint.encode("ascii"):
        return "other model fingerprint"
    if dtype.rstrip(b"\0") != expected.dtype.encode("ascii"):
        return "other dtype"
    if block_size != expected.block_size:
        return "other block size"
    if ndim > MAX_NDIM or tuple(shape[:ndim]) != expected.shape:
        return "other shape"
    if length != expected.num_bytes:
        return "payload length does not match the shape"
    if len(blob) < HEADER_SIZE + length:
        return "truncated payload"
    if len(blob) > HEADER_SIZE + length:
        return "trailing bytes after the payload"
    return None


# Reasons already logged: a bad tier can hand back thousands of bad blobs a second, and one
# line per reason is enough to act on.
_logged_reasons: set[str] = set()
_logged_lock = threading.Lock()

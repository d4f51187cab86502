"""Block keys: chained block hashes, equal on every node of the rack.

A block's key certifies its whole prefix: ``key_i = H(key_{i-1}, tokens of block i, extra
keys)``, with ``H(x) = SHA-256(canonical CBOR(x))`` (vLLM v1's ``sha256_cbor``). The chain's root
is derived from a **seed pinned for the rack** (configuration, never per process: vLLM's
``NONE_HASH`` is random per process unless ``PYTHONHASHSEED`` is set, which would make every
node's keys differ) and from the **namespace** (model, KV layout, dtype, parallel rank), so two
models never share entries even when their token ids agree.

Equal to vLLM's own block hashes: build the scheme with ``vllm_compatible=True`` and
``seed=<the PYTHONHASHSEED string vLLM runs with>``, and run vLLM with
``--prefix-caching-hash-algo sha256_cbor``. The root is then exactly vLLM's
``NONE_HASH = sha256_cbor(PYTHONHASHSEED)`` and every key equals vLLM's ``BlockHash`` for the
same tokens and extra keys. The namespace is then *not* folded in, so keep one region (or one
seed) per model in that mode.

Keys are 32 bytes; the index stores all 256 bits, so a collision of the bucket bits is detected
by the full compare, never trusted.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import cbor2

KEY_BYTES = 32


class BlockKey(bytes):
    """A 32-byte chained block hash. ``int(key.word(i))`` are its four little-endian u64 words."""

    __slots__ = ()

    def __new__(cls, raw: bytes) -> "BlockKey":
        if len(raw) != KEY_BYTES:
            raise ValueError(f"a block key has {KEY_BYTES} bytes, got {len(raw)}")
        return super().__new__(cls, raw)

    def word(self, i: int) -> int:
        return int.from_bytes(self[8 * i:8 * i + 8], "little")

    def __repr__(self) -> str:
        return f"BlockKey({self[:8].hex()}…)"


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of canonical CBOR: deterministic across processes, interpreters and machines."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """What must match for two blocks to be interchangeable."""
    model: str
    num_layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: str
    rank: int = 0
    world_size: int = 1

    def as_tuple(self) -> tuple:
        return (self.model, self.num_layers, self.block_tokens, self.kv_heads, self.head_dim,
                self.dtype, self.rank, self.world_size)


class KeyScheme:
    """Computes block keys for one namespace and rack seed."""

    def __init__(self, *, seed: str | int | bytes, namespace: Namespace | None,
                 vllm_compatible: bool = False) -> None:
        if vllm_compatible:
            if not isinstance(seed, str):
                raise ValueError("vllm_compatible keys need the PYTHONHASHSEED *string* as seed")
            self.root = sha256_cbor(seed)
        else:
            if namespace is None:
                raise ValueError("a namespace is required unless vllm_compatible=True")
            self.root = sha256_cbor(["tract-keys-v1", seed, list(namespace.as_tuple())])
        self.namespace = namespace
        self.block_tokens = namespace.block_tokens if namespace else None

    def chain(self, token_ids: Sequence[int], block_tokens: int, *,
              extra_keys: Sequence[Any] | None = None,
              parent: bytes | None = None) -> list[BlockKey]:
        """One key per *full* block of ``token_ids`` (a trailing partial block has none).

        ``extra_keys`` (a LoRA name, a cache salt, ...) apply to every block, as a tuple, like
        vLLM's; ``parent`` continues a chain from an earlier key.
        """
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        ids = [int(t) for t in token_ids]
        extra = tuple(extra_keys) if extra_keys else None
        prev = parent if parent is not None else self.root
        out: list[BlockKey] = []
        for start in range(0, len(ids) - block_tokens + 1, block_tokens):
            prev = sha256_cbor((prev, tuple(ids[start:start + block_tokens]), extra))
            out.append(BlockKey(prev))
        return out


def keys_to_words(keys: Iterable[bytes]) -> "np.ndarray":  # noqa: F821
    """(n, 4) uint64 array of the keys' words, for the jitted index."""
    import numpy as np
    ks = list(keys)
    if not ks:
        return np.zeros((0, 4), dtype=np.uint64)
    if set(map(len, ks)) != {KEY_BYTES}:          # C loops: ~25 instead of ~120 µs per 1024 keys
        bad = next(k for k in ks if len(k) != KEY_BYTES)
        raise ValueError(f"a block key has {KEY_BYTES} bytes, got {len(bad)}")
    return np.frombuffer(b"".join(ks), dtype="<u8").reshape(len(ks), 4).copy()


class KeyBatch:
    """The keys of one operation and their index words: one value, not a pair.

    A put or read needs its keys as bytes (the book of blocks in flight, error messages,
    announcements) and as words (``keys_to_words``: what the jitted index probes). Both travel
    together from the transaction that computed the words once down to the index, the fill
    book and the eviction policy. The transactions (``stores/txn.py``) are key batches
    themselves, so that a step hands itself on and nothing is built per operation; ``words``
    is None there until a step needs it (a later layer of blocks in flight needs none).
    Everything a batch is handed to reads ``words`` as set."""
    __slots__ = ("keys", "words")

    def __init__(self, keys: list[bytes], words: "np.ndarray | None" = None) -> None:  # noqa: F821
        self.keys = keys
        self.words = keys_to_words(keys) if words is None else words

    def __len__(self) -> int:
        return len(self.keys)

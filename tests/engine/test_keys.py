"""Block keys: chained, deterministic across interpreters, namespaced, vLLM-compatible on request."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import cbor2
import pytest

from tract_async.keys import BlockKey, KeyScheme, Namespace, keys_to_words

NS = Namespace(model="llama3-8b", num_layers=32, block_tokens=16, kv_heads=8, head_dim=128,
               dtype="bfloat16")


def test_one_key_per_full_block_and_chaining() -> None:
    s = KeyScheme(seed="rack", namespace=NS)
    ids = list(range(50))
    keys = s.chain(ids, 16)
    assert len(keys) == 3                           # 48 tokens in full blocks, 2 left over
    assert all(isinstance(k, BlockKey) and len(k) == 32 for k in keys)
    # a shared prefix gives shared leading keys; a change in block 1 changes keys 1.. only
    other = ids[:20] + [999] + ids[21:]
    k2 = s.chain(other, 16)
    assert k2[0] == keys[0] and k2[1] != keys[1] and k2[2] != keys[2]
    # continuing a chain from a parent equals chaining the whole
    assert s.chain(ids[16:], 16, parent=keys[0]) == keys[1:]


def test_namespace_seed_and_extra_keys_separate() -> None:
    base = KeyScheme(seed="rack", namespace=NS).chain(range(32), 16)
    other_model = KeyScheme(seed="rack", namespace=Namespace(**{**NS.__dict__, "model": "x"}))
    other_rank = KeyScheme(seed="rack", namespace=Namespace(**{**NS.__dict__, "rank": 1}))
    other_seed = KeyScheme(seed="rack2", namespace=NS)
    for s in (other_model, other_rank, other_seed):
        assert not set(s.chain(range(32), 16)) & set(base)
    lora = KeyScheme(seed="rack", namespace=NS).chain(range(32), 16, extra_keys=["lora-a"])
    assert not set(lora) & set(base)


def test_equal_across_fresh_interpreters() -> None:
    code = ("from tract_async.keys import KeyScheme, Namespace\n"
            "ns = Namespace(model='m', num_layers=2, block_tokens=4, kv_heads=1, head_dim=8, dtype='float32')\n"
            "print(','.join(k.hex() for k in KeyScheme(seed='s', namespace=ns).chain(range(13), 4, extra_keys=['salt'])))\n")
    outs = set()
    for hashseed in ("0", "12345"):   # different PYTHONHASHSEED: must not matter
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"PYTHONHASHSEED": hashseed, "PATH": "/usr/bin:/bin"}, timeout=120)
        assert res.returncode == 0, res.stderr
        outs.add(res.stdout.strip())
    assert len(outs) == 1 and outs.pop().count(",") == 2


def _vllm_reference(seed: str, ids: list[int], block: int, extra) -> list[bytes]:
    """vLLM v1 with --prefix-caching-hash-algo sha256_cbor, written from its documented
    definition: NONE_HASH = sha256_cbor(PYTHONHASHSEED), hash = sha256_cbor((parent, tokens, extra))."""
    def h(x) -> bytes:
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
    parent = h(seed)
    out = []
    for i in range(0, len(ids) - block + 1, block):
        parent = h((parent, tuple(ids[i:i + block]), extra))
        out.append(parent)
    return out


def test_vllm_compatible_mode_matches_reference() -> None:
    s = KeyScheme(seed="42", namespace=None, vllm_compatible=True)
    ids = list(range(100, 164))
    assert s.chain(ids, 16) == _vllm_reference("42", ids, 16, None)
    assert s.chain(ids, 16, extra_keys=["lora"]) == _vllm_reference("42", ids, 16, ("lora",))
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        KeyScheme(seed=42, namespace=None, vllm_compatible=True)


def test_keys_to_words() -> None:
    keys = KeyScheme(seed="rack", namespace=NS).chain(range(32), 16)
    w = keys_to_words(keys)
    assert w.shape == (2, 4) and int(w[1, 3]) == keys[1].word(3)
    with pytest.raises(ValueError):
        keys_to_words([b"short"])

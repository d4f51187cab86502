"""What the GPU tests share: the bf16 layout of the Llama-3-8B head geometry with few layers,
seeded random KV on the device, and a bit-for-bit comparison. Imports torch (GPU test modules
only)."""
from __future__ import annotations

import torch

import tract_async as tract


def layout(L: int = 4) -> tract.KVLayout:
    """16-token blocks, 8 KV heads x 128, bf16, ``L`` layers (64 KiB a block and layer)."""
    return tract.KVLayout(num_layers=L, block_tokens=16, kv_heads=8, head_dim=128,
                          dtype=torch.bfloat16)


def rand_kv(lay: tract.KVLayout, n: int, seed: int) -> torch.Tensor:
    """``n`` blocks of every layer, the same for the same seed, on the current CUDA device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(lay.kv_shape(n), generator=g).to(lay.dtype).cuda()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape and the same bytes."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))

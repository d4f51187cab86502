"""One node stores a prompt's KV cache in a shared region and reads it back (CPU, /dev/shm).

    python examples/quickstart.py [REGION_PATH]

The region is removed when the engine closes (remove_on_close), also on Ctrl-C.
"""
import sys

import torch

import tract_async as tract


async def main(region: str) -> None:
    layout = tract.KVLayout(num_layers=32, block_tokens=16, kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16)       # Llama-3-8B: 2 MiB per 16-token block
    cfg = tract.EngineConfig(region=region, region_bytes=1 << 28, create=True,
                             remove_on_close=True, node_id=0, layout=layout, namespace="llama3-8b")
    token_ids = list(range(100))                        # a prompt: 6 full blocks and 4 tokens
    async with tract.Engine.open(cfg) as eng:
        keys = eng.block_keys(token_ids)                # a key per full block, same on every node
        hit = eng.lookup(keys)                          # leading blocks resident and complete: 0
        kv = torch.randn(layout.kv_shape(len(keys)), dtype=layout.dtype)  # what prefill computed
        await eng.put_kv(keys, kv)                      # (num_layers, 2, 6*16, 8, 128)
        print(f"stored {len(keys)} blocks ({hit} were resident)")

        # the next turn extends the prompt: its first 6 blocks are a prefix hit, the rest is
        # stored layer by layer, as prefill computes each layer
        keys2 = eng.block_keys(token_ids + list(range(1000, 1060)))
        hit = eng.lookup(keys2)
        kv_new = torch.randn(layout.kv_shape(len(keys2) - hit), dtype=layout.dtype)
        for i in range(layout.num_layers):
            await eng.put_kv(keys2[hit:], kv_new[i], layer=i)

        kv2 = await eng.get_kv(keys2, timeout=1.0)      # waits for layers still being produced
        assert torch.equal(kv2, torch.cat([kv, kv_new], dim=2))
        mib = kv2.numel() * kv2.element_size() >> 20
        print(f"prefix hit {hit}/{len(keys2)} blocks; read back {mib} MiB, bit-exact")
        s = eng.stats()                                 # hits, misses, bytes, evictions, ...
        print(f"stats: {s['blocks_stored']} blocks stored, {s['hits']} read, "
              f"{s['bytes_put'] >> 20} MiB in, {s['bytes_got'] >> 20} MiB out")


if __name__ == "__main__":
    tract.run(main(sys.argv[1] if len(sys.argv) > 1 else "/dev/shm/tract-quickstart"))

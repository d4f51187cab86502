"""The core without torch: a process that cannot import torch puts and gets numpy arrays through
a region, runs the region tools, and gets MissingExtra (with the install line) where torch is
needed. Why: torch is an extra (``tract_async/arrays.py``); this keeps the core free of it.

Each case runs in a fresh interpreter with ``sys.modules["torch"] = None``, which makes
``import torch`` fail and ``importlib.util.find_spec("torch")`` answer None, as on a machine
without torch.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRELUDE = """
import sys
sys.modules["torch"] = None       # as if torch were not installed
"""

EPILOGUE = """
loaded = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == "torch")
assert not loaded, loaded
print("OK")
"""


def _run(body: str, timeout: float = 240) -> str:
    code = PRELUDE + textwrap.dedent(body) + EPILOGUE
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), \
        f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
    return p.stdout


def test_engine_puts_and_gets_numpy_arrays_without_torch(region_path: str) -> None:
    out = _run(f"""
        import asyncio
        import numpy as np
        import tract_async as tract
        from tract_async.errors import TensorMismatch

        async def main():
            lay = tract.KVLayout(num_layers=3, block_tokens=4, kv_heads=2, head_dim=8)
            assert lay.dtype == "bfloat16" and lay.itemsize == 2
            cfg = tract.EngineConfig(layout=lay, region={region_path!r}, region_bytes=8 << 20,
                                     create=True)
            async with tract.Engine.open(cfg) as eng:
                keys = eng.block_keys(np.arange(4 * 5))
                rng = np.random.default_rng(1)
                kv = rng.integers(0, 1 << 16, lay.kv_shape(5), dtype=np.uint16)  # bfloat16 bits
                assert await eng.put_kv(keys[:3], kv[:, :, :12]) == 3
                for layer in range(lay.num_layers):               # layer streaming, 2 more
                    await eng.put_kv(keys[3:], np.ascontiguousarray(kv[layer, :, 12:]),
                                     layer=layer)
                assert eng.lookup(keys) == 5
                got = await eng.get_kv(keys)
                assert isinstance(got, np.ndarray) and got.dtype == np.uint16
                assert np.array_equal(got, kv)
                one = np.zeros(lay.kv_shape(5, 2), dtype=np.uint16)
                assert await eng.get_kv(keys, layer=2, out=one) is one
                assert np.array_equal(one, kv[2])
                for bad, why in [(kv.astype(np.float32), "dtype"), (kv[:, :, :8], "shape"),
                                 (kv.tolist(), "numpy array")]:
                    try:
                        await eng.put_kv(keys, bad)
                    except TensorMismatch as e:
                        assert why in str(e), e
                    else:
                        raise AssertionError(f"a bad kv ({{why}}) was taken")
                try:
                    await eng.get_kv(keys, device="cuda:0")
                except tract.TractError as e:   # the CUDA path needs torch: named, with the fix
                    assert "torch" in str(e), e
                else:
                    raise AssertionError("device='cuda' without torch")
            lay32 = tract.KVLayout(num_layers=1, block_tokens=4, kv_heads=1, head_dim=4,
                                   dtype="float32")
            assert lay32.dtype == "float32" and lay32.itemsize == 4
        asyncio.run(main())
    """)
    assert "OK" in out


def test_region_tools_without_torch(region_path: str) -> None:
    _run(f"""
        import contextlib, io
        from tract_async import cli
        for argv in (["region", "init", {region_path!r}, "--size", "8M"],
                     ["region", "inspect", {region_path!r}],
                     ["region", "fsck", {region_path!r}]):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = cli.main(argv)
            assert rc == 0, (argv, rc, buf.getvalue())
        assert "clean" in buf.getvalue().lower(), buf.getvalue()
    """)


def test_network_store_without_torch_names_the_install() -> None:
    _run("""
        import asyncio
        import tract_async as tract
        from tract_async.errors import MissingExtra

        async def main():
            lay = tract.KVLayout(num_layers=1, block_tokens=4, kv_heads=1, head_dim=8)
            cfg = tract.EngineConfig(layout=lay, region=None, peers=["http://127.0.0.1:9"],
                                     secret=b"s" * 32)
            try:
                async with tract.Engine.open(cfg):
                    pass
            except MissingExtra as e:
                assert "torch" in str(e) and "pip install" in str(e), e
            else:
                raise AssertionError("the network store opened without torch")
        asyncio.run(main())
    """)


def test_layout_with_torch_holds_the_torch_dtype() -> None:
    torch = pytest.importorskip("torch")
    import tract_async as tract
    lay = tract.KVLayout(num_layers=1, block_tokens=4, kv_heads=1, head_dim=8)
    assert lay.dtype is torch.bfloat16 and lay.dtype_name == "bfloat16"
    assert tract.KVLayout(num_layers=1, block_tokens=4, kv_heads=1, head_dim=8,
                          dtype="float16").dtype is torch.float16
    assert lay == tract.KVLayout(num_layers=1, block_tokens=4, kv_heads=1, head_dim=8,
                                 dtype=torch.bfloat16)


def test_http_agent_reads_numpy_memory_without_torch() -> None:
    """The aiohttp agent (the NIXL-style transport) registers numpy arrays and READs them from a
    peer, with torch absent."""
    _run("""
        import asyncio
        import numpy as np
        from tract_async.transport.http import Agent

        async def main():
            secret = b"test-secret-0123456789abcdef"
            a, b = Agent("a", secret=secret), Agent("b", secret=secret)
            src = np.arange(1 << 16, dtype=np.uint32)
            dst = np.zeros(src.nbytes, dtype=np.uint8)
            a.register_memory(src, name="kv", writable=False)
            b.register_memory(dst, name="dst")
            await a.start()
            await b.start()
            try:
                b.add_remote_agent(a.get_agent_metadata())
                # as in NIXL: an N x 3 array is a descriptor list, so numpy memory is named
                # by (addr, nbytes, dev_id) rows
                local = b.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
                h = b.initialize_xfer("READ", local,
                                      b.get_xfer_descs(b.remote_region("a", "kv")), "a")
                await b.transfer(h, timeout=10)
                assert np.array_equal(dst.view(np.uint32), src)
                h.release()
            finally:
                await b.close()
                await a.close()
        asyncio.run(main())
    """)

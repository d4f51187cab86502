"""The cold-cache notice: a first run says what it compiles, where, and about how long."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tract_async.cli import build_parser
from tract_async.tools.warmup import cache_state


def test_warm_after_the_sessions_warm_up() -> None:
    """conftest's session fixture ran warm_up(): every module's kernels are in the cache."""
    st = cache_state()
    assert st is not None
    assert not st.cold and st.cold_functions == 0, st
    assert st.total_functions > 50


def test_a_cold_cache_is_announced_once_with_counts(tmp_path) -> None:
    """A fresh NUMBA_CACHE_DIR (Numba reads it at import: hence a process of its own). The
    notice comes before anything compiles, names the modules and the directory, once."""
    code = ("from tract_async.tools.warmup import notice_if_cold\n"
            "st = notice_if_cold()\nassert st is not None and st.cold\n"
            "assert notice_if_cold() is None\n"
            "print(st.cold_functions, st.total_functions, len(st.cold_modules))\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    cold, total, modules = map(int, res.stdout.split())
    assert cold == total and modules >= 5
    lines = [line for line in res.stderr.splitlines() if line.startswith("tract: compiling")]
    assert len(lines) == 1, res.stderr
    assert f"compiling {total} Numba kernels" in lines[0] and str(tmp_path / "numba") in lines[0]
    assert "index" in lines[0] and "about" in lines[0] and "tract warmup" in lines[0]


def test_warmup_is_a_cli_subcommand() -> None:
    args = build_parser().parse_args(["warmup", "--backend", "hw"])
    assert args.backend == ["hw"] and callable(args.func)


def test_nothing_compiles_after_the_warm_up(tmp_path) -> None:
    """An engine process on the session's warm cache (conftest's warm_up stamped it) puts,
    waits for a layer (stores/waits.py: the 6 kernels the demo's workers still compiled after
    "region kernels ready", issue 36) and reads: Numba compiles nothing after Engine.open's
    warm-up (its "numba:compile" events, which a cache load does not fire)."""
    path = f"/dev/shm/tract-test-warm-{os.getpid()}"
    code = f"""
import asyncio, numpy as np, tract_async as tract
from tract_async.tools import warmup
async def main():
    lay = tract.KVLayout(num_layers=2, block_tokens=4, kv_heads=1, head_dim=8, dtype="float32")
    cfg = dict(layout=lay, region={path!r}, region_bytes=16 << 20, namespace="w")
    async with tract.Engine.open(tract.EngineConfig(**cfg, create=True, node_id=0)) as a, \\
               tract.Engine.open(tract.EngineConfig(**cfg, node_id=1)) as b:
        keys = a.block_keys(list(range(8)))
        kv = np.ones(lay.kv_shape(len(keys)), dtype=np.float32)
        wait = asyncio.create_task(b.get_kv(keys, layer=1, timeout=30))
        await asyncio.sleep(0)          # the waiter runs until it waits (no block yet)
        for layer in range(2):
            await a.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
        await wait
        assert np.array_equal(await b.get_kv(keys), kv)
    # a decode worker's layer-streamed reads in transfer mode (the known-slot path: the cold
    # demo's decode compiled rows_fine and refresh_layers_batch[_held] after the warm-up)
    lay = tract.KVLayout(num_layers=4, block_tokens=16, kv_heads=2, head_dim=32, dtype="float32")
    cfg = dict(layout=lay, region={path!r} + "-t", region_bytes=16 << 20, namespace="t",
               mode="transfer")
    async with tract.Engine.open(tract.EngineConfig(**cfg, create=True, node_id=0)) as a, \
               tract.Engine.open(tract.EngineConfig(**cfg, node_id=1)) as b:
        keys = a.block_keys(list(range(16 * 40)), extra_keys=("r",))
        kv = np.ones(lay.kv_shape(len(keys)), dtype=np.float32)
        async def read():
            return [await b.get_kv(keys, layer=i, timeout=30) for i in range(4)]
        reader = asyncio.create_task(read())
        for layer in range(4):
            await a.put_kv(keys, np.ascontiguousarray(kv[layer]), layer=layer)
        assert all(np.array_equal(x, kv[i]) for i, x in enumerate(await reader))
    print("compiled after the warm-up:", warmup.compiles_after_warmup())
    assert warmup.compiles_after_warmup() == []
tract.run(main())
"""
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
    finally:
        from tract_async.region import cpumarks
        for p in (path, path + "-t"):
            if os.path.exists(p):
                os.unlink(p)
            cpumarks.remove(p, None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compiled after the warm-up: []" in res.stdout


@pytest.mark.slow
def test_a_cold_ensure_warm_compiles_in_a_child_and_this_process_only_loads(tmp_path) -> None:
    """Engine.open's warm-up on a cold cache (a fresh NUMBA_CACHE_DIR): the scenario runs in a
    child process (kernel_cache, which imports no Engine: no import cycle), which stamps the
    cache; the opener itself compiles nothing, before or after (it loads what the child
    compiled), and a second ensure_warm finds the stamp. ~1 min on two cores: marked slow."""
    code = """
import asyncio, os
from numba.core import event as ev
from tract_async import kernel_cache
compiled = []
class L(ev.Listener):
    def on_start(self, event): compiled.append(event)
    def on_end(self, event): pass
ev.register("numba:compile", L())
stamp = kernel_cache.stamp_path("hw")
assert stamp is not None and not os.path.exists(stamp)
assert asyncio.run(kernel_cache.ensure_warm("hw")) is True
assert os.path.exists(stamp)
assert asyncio.run(kernel_cache.ensure_warm("hw")) is False
print("compiled here:", len(compiled))
"""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compiled here: 0" in res.stdout, res.stdout + res.stderr


def test_the_warm_up_imports_no_torch() -> None:
    """.ci/run installs the extras (transformers among them) while the warm-up compiles, and
    the core needs no torch: the warm-up imports neither. Its scenario reads into numpy arrays
    (a get without ``out`` returns a torch tensor where torch is installed)."""
    code = ("import sys\nfrom tract_async.tools.warmup import warm_up\nwarm_up(backends=('hw',))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout

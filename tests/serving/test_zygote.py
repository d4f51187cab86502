"""Services forked from the warm zygote (tract_async.serving.zygote) behave as exec'd ones: a
failed start is reported with its status and log, a killed launcher leaves no process behind,
a zygote that cannot fork falls back to exec, and the choice between the two follows the
device. (That forked racks serve the same tokens as exec'd ones: test_serving_e2e.py.)"""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tract_async.serving import launcher
from tract_async.serving.errors import ServiceStartFailed
from tract_async.serving.service import ServiceConfig
from tract_async.serving.zygote import (KEY_IGNORES, LAUNCH_ENV, ForkedProcess, ZygoteError,
                                        use_fork, zygote_key)

pytestmark = pytest.mark.xdist_group("racks")


def test_use_fork_follows_the_mode_and_the_device(monkeypatch) -> None:
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    assert use_fork("auto", "cpu") and use_fork(None, "cpu") and use_fork("fork", None)
    assert not use_fork("exec", "cpu")
    assert not use_fork("auto", "cuda:0") and not use_fork(None, "cuda")
    with pytest.raises(ValueError, match="CPU services"):
        use_fork("fork", "cuda:1")
    with pytest.raises(ValueError, match="launch must be one of"):
        use_fork("spawn", "cpu")
    monkeypatch.setenv(LAUNCH_ENV, "exec")
    assert not use_fork(None, "cpu") and use_fork("fork", "cpu")


def test_a_zygote_is_reused_for_the_same_environment_only() -> None:
    env = {"A": "1", "NUMBA_CACHE_DIR": "/x"}
    assert zygote_key(env, "/w") == zygote_key(dict(env), "/w")
    for ignored in KEY_IGNORES:
        assert zygote_key({**env, ignored: "t1"}, "/w") == zygote_key({**env, ignored: "t2"}, "/w")
    assert zygote_key({**env, "NUMBA_CACHE_DIR": "/y"}, "/w") != zygote_key(env, "/w")
    assert zygote_key(env, "/v") != zygote_key(env, "/w")


def _bad_prefill(tmp_path) -> ServiceConfig:  # noqa: ANN001
    # a region in a directory that does not exist: the prefill cannot create it and exits
    return ServiceConfig(role="prefill", mode="region-transfer", node_id=0, create_region=True,
                         region=str(tmp_path / "no-such-dir" / "region"), die_with_parent=True)


@pytest.mark.parametrize("launch", ["fork", "exec"])
async def test_a_failed_start_is_reported_with_its_status_and_log(tmp_path, launch) -> None:
    log = str(tmp_path / "prefill.log")
    with pytest.raises(ServiceStartFailed, match=r"prefill exited with status 1 before it was "
                                                 r"ready") as info:
        await launcher.spawn_service(_bad_prefill(tmp_path), log_path=log, launch=launch,
                                     start_timeout_s=60)
    assert "no-such-dir" in str(info.value)        # the end of its log, with the traceback


async def test_a_zygote_that_cannot_fork_falls_back_to_exec(tmp_path, monkeypatch, caplog) -> None:
    def refuse() -> None:
        raise ZygoteError("refused for the test")
    monkeypatch.setattr(launcher, "zygote", refuse)
    seen: list[object] = []
    real_exec = launcher._exec

    async def spy(*args: object, **kw: object) -> asyncio.subprocess.Process:
        proc = await real_exec(*args, **kw)  # type: ignore[arg-type]
        seen.append(proc)
        return proc
    monkeypatch.setattr(launcher, "_exec", spy)
    with caplog.at_level(logging.WARNING, logger=launcher.__name__), \
            pytest.raises(ServiceStartFailed, match="status 1"):
        await launcher.spawn_service(_bad_prefill(tmp_path), log_path=str(tmp_path / "p.log"),
                                     launch="fork", start_timeout_s=60)
    assert len(seen) == 1 and isinstance(seen[0], asyncio.subprocess.Process)
    assert "refused for the test" in caplog.text and "exec'd" in caplog.text


LAUNCHER = textwrap.dedent("""
    import asyncio, os, sys
    from tract_async.serving.launcher import Rack
    from tract_async.serving.zygote import zygote
    async def main():
        rack = Rack(mode="region-transfer", region=sys.argv[1], log_dir=sys.argv[2],
                    torch_threads=1, launch="fork")
        await rack.start()
        pids = [sp.proc.pid for sp in rack.services] + [zygote().proc.pid]
        print(" ".join(map(str, pids)), flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_launcher_leaves_no_service_and_no_zygote(region_path, tmp_path) -> None:
    """SIGKILL the launcher of a forked rack: the zygote gets SIGKILL (its parent-death
    signal), and the services SIGTERM (theirs, for the zygote): every process goes."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, region_path, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        pids = [int(p) for p in line.split()]
        assert len(pids) == 4, line
        for pid in pids[:3]:
            with open(f"/proc/{pid}/cmdline", "rb") as f:      # ps shows the service
                assert b"tract_async.serving\0" in f.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 60
        while not all(_gone(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if not _gone(p)]
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_forked_service_reports_a_signal_as_its_exit_status(tmp_path) -> None:
    cfg = ServiceConfig(role="router", mode="region-transfer", prefill_url="http://127.0.0.1:9",
                        decode_url="http://127.0.0.1:9", die_with_parent=True)
    sp = await launcher.spawn_service(cfg, log_path=str(tmp_path / "r.log"), launch="fork")
    assert isinstance(sp.proc, ForkedProcess)
    sp.proc.kill()
    assert await asyncio.wait_for(sp.proc.wait(), 30) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        sp.proc.send_signal(signal.SIGTERM)
    assert await launcher.stop_service(sp) == -signal.SIGKILL


def test_a_failed_preload_is_a_reason_not_a_crash() -> None:
    """A zygote whose imports fail (a core-only install has no transformers) refuses each spawn
    with the reason (the launcher then execs), instead of dying with a traceback."""
    from tract_async.serving.zygote import _preload
    why = _preload(("tract_async_no_such_module",))
    assert why is not None and "ModuleNotFoundError" in why and "tract_async_no_such_module" in why

"""``EngineConfig.cpu_wake_latency_us``: a PM QoS request held exactly while the engine is open
(``tract_async/host/cpu_qos.py``), a warning (never an error) where it cannot be made."""
from __future__ import annotations

import logging
import os

import pytest

import tract_async as tract
from tests.support.engine_util import cfg
from tract_async.host.cpu_qos import CpuLatencyRequest
from tract_async.errors import ConfigError


def test_the_request_is_written_and_dropped(tmp_path) -> None:  # noqa: ANN001
    f = tmp_path / "qos"
    f.write_bytes(b"")
    req = CpuLatencyRequest(7, path=str(f))
    assert req.acquire() and req.held
    assert f.read_bytes() == (7).to_bytes(4, "little")
    fd = req._fd
    req.release()
    assert not req.held
    with pytest.raises(OSError):
        os.fstat(fd)                      # the file is closed: the kernel drops the request
    req.release()                         # idempotent


def test_an_unwritable_file_warns_and_holds_nothing(tmp_path, caplog) -> None:  # noqa: ANN001
    req = CpuLatencyRequest(0, path=str(tmp_path / "missing" / "qos"))
    with caplog.at_level(logging.WARNING, logger="tract_async.host.cpu_qos"):
        assert not req.acquire()
    assert not req.held and "FileNotFoundError" in req.why_not
    assert "cpu_wake_latency_us=0 not applied" in caplog.text


@pytest.mark.parametrize("bad", [-1, True, 1.5, "0"])
def test_bad_values_are_refused(region_path: str, bad: object) -> None:
    with pytest.raises(ConfigError, match="cpu_wake_latency_us"):
        cfg(region_path, 0, create=True, cpu_wake_latency_us=bad)
    with pytest.raises(ValueError):
        CpuLatencyRequest(bad)  # type: ignore[arg-type]


async def test_the_engine_holds_it_while_open(region_path: str) -> None:
    eng = await tract.Engine.open(cfg(region_path, 0, create=True, cpu_wake_latency_us=0))
    try:
        qos = eng._cpu_qos
        assert qos is not None
        # held where this user may write /dev/cpu_dma_latency, else a reason is recorded
        assert qos.held or qos.why_not
    finally:
        await eng.close()
    assert eng._cpu_qos is None and not qos.held

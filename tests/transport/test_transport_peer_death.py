"""A peer killed with SIGKILL in the middle of a transfer: a real second process, a real socket.

The child serves 128 MiB; the parent starts a READ, waits until the first bytes arrived (so the
kill lands mid-transfer, ordered by an observed event rather than a sleep), kills the child, and
expects PeerDisconnected. The parent agent keeps serving and its registered bytes are unchanged.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys

import pytest
import torch

from tract_async.transport import errors as E
from tract_async.transport.http import Agent

SECRET = "peer-death-secret-0123456789"
SIZE = 128 << 20
pytestmark = pytest.mark.timeout(120)

CHILD = f"""
import asyncio, sys
import numpy as np
from tract_async.transport.http import Agent

async def main():
    agent = Agent("child", secret={SECRET!r})
    agent.register_memory(np.full({SIZE}, 0xAB, dtype=np.uint8), name="kv", writable=False)
    await agent.start()
    sys.stdout.write(agent.get_agent_metadata().hex() + "\\n")
    sys.stdout.flush()
    await asyncio.Event().wait()   # serve until killed

asyncio.run(main())
"""


async def test_peer_killed_mid_transfer():
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, stdout=asyncio.subprocess.PIPE,
                                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    parent = Agent("parent", secret=SECRET, io_timeout_s=10.0)
    export = torch.arange(1 << 16, dtype=torch.int64)
    parent.register_memory(export, name="export", writable=False)
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    parent.register_memory(dst, name="dst")
    export_digest = hashlib.sha256(export.numpy().tobytes()).hexdigest()
    try:
        async with asyncio.timeout(60):
            line = await proc.stdout.readline()
        assert line, "child exited before publishing its metadata"
        await parent.start()
        child = parent.add_remote_agent(bytes.fromhex(line.decode().strip()))
        h = parent.initialize_xfer("READ", parent.get_xfer_descs(dst),
                                   parent.get_xfer_descs(parent.remote_region(child, "kv")), child)
        parent.post_xfer(h)
        async with asyncio.timeout(30):     # wait for the observed event "bytes are flowing"
            while h.bytes_done == 0:
                await asyncio.sleep(0.001)
                parent.check_xfer_state(h)  # raises early if the transfer failed before any byte
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        with pytest.raises(E.PeerDisconnected):
            await parent.transfer(h, timeout=30)
        assert 0 < h.bytes_done < SIZE
        with pytest.raises(E.PeerDisconnected):
            parent.check_xfer_state(h)
        # The parent still serves: a fresh agent reads its export.
        async with Agent("other", secret=SECRET) as other:
            got = torch.zeros_like(export)
            other.register_memory(got)
            other.add_remote_agent(parent.get_agent_metadata())
            h2 = other.initialize_xfer("READ", other.get_xfer_descs(got),
                                       other.get_xfer_descs(other.remote_region("parent", "export")), "parent")
            await other.transfer(h2, timeout=10)
            assert torch.equal(got, export)
        assert hashlib.sha256(export.numpy().tobytes()).hexdigest() == export_digest
        # A new transfer to the dead peer fails fast and clearly.
        h3 = parent.initialize_xfer("READ", parent.get_xfer_descs([(dst.data_ptr(), 16, 0)], "DRAM"),
                                    parent.get_xfer_descs([parent.remote_region(child, "kv").desc(0, 16)], "DRAM"),
                                    child)
        with pytest.raises(E.PeerUnreachable):
            await parent.transfer(h3, timeout=10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await parent.close()

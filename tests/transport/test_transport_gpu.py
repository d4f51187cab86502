"""The CUDA path of the HTTP transport: VRAM ranges move through pinned staging buffers.

Skipped without CUDA (this CPU machine); runs on a GPU host with ``-m gpu``.
"""
from __future__ import annotations

import pytest
import torch

from tract_async.transport.http import Agent

SECRET = b"gpu-secret-0123456789abcdef"
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


async def test_read_from_and_write_into_cuda_tensors():
    # Chunks smaller than the ranges, so staging is refilled several times and the tail is partial.
    async with Agent("gpu", secret=SECRET, chunk_bytes=1 << 16) as srv, \
            Agent("cpu", secret=SECRET, chunk_bytes=1 << 16) as cli:
        src = torch.arange((1 << 18) + 7, dtype=torch.uint8, device="cuda")
        inbox = torch.zeros_like(src)
        srv.register_memory(src, name="kv", writable=False)
        srv.register_memory(inbox, name="inbox")
        cli.add_remote_agent(srv.get_agent_metadata())
        host = torch.zeros(src.numel(), dtype=torch.uint8)
        cli.register_memory(host)
        h = cli.initialize_xfer("READ", cli.get_xfer_descs(host),
                                cli.get_xfer_descs(cli.remote_region("gpu", "kv")), "gpu")
        await cli.transfer(h, timeout=60)
        assert torch.equal(host, src.cpu())
        h = cli.initialize_xfer("WRITE", cli.get_xfer_descs(host),
                                cli.get_xfer_descs(cli.remote_region("gpu", "inbox")), "gpu", b"w")
        await cli.transfer(h, timeout=60)
        torch.cuda.synchronize()
        assert torch.equal(inbox, src)
        # A CUDA tensor as the *local* side of a READ: staged on the client.
        dst = torch.zeros_like(src)
        cli.register_memory(dst)
        h = cli.initialize_xfer("READ", cli.get_xfer_descs(dst),
                                cli.get_xfer_descs(cli.remote_region("gpu", "kv")), "gpu")
        await cli.transfer(h, timeout=60)
        torch.cuda.synchronize()
        assert torch.equal(dst, src)

"""Relative load points of ``tract bench serve``: ``--rates 0.75x`` is 0.75 times the peak that
the reference system measured in its closed loop of the same workload (the paper compares at
70-80 % of the baseline's peak, which no fixed rate hits on every host)."""
from __future__ import annotations

import pytest

from tract_async.loadtest import runner as LB


def test_relative_rates_put_the_closed_loops_first() -> None:
    args = LB.resolve_args(["--size", "smoke", "--workloads", "chat,rag", "--sweep", "chat",
                            "--rates", "2,0.5x,0.75x", "--concurrency", "2,4"])
    assert args.rate_list == [2.0] and args.rel_rate_list == [0.5, 0.75]
    assert LB.loads(args, "chat") == [("closed", 2.0), ("closed", 4.0), ("open", 2.0),
                                      ("open-rel", 0.5), ("open-rel", 0.75)]
    assert LB.loads(args, "rag") == [("closed", 2.0), ("open-rel", 0.5)]   # outside the sweep
    plan = LB.phase_plan(args)
    assert [s.phase for s in plan] == list(range(1, 8))
    assert plan[3].label == "0.5x peak"


def test_a_relative_rate_scales_the_reference_peak() -> None:
    args = LB.resolve_args(["--size", "smoke", "--rates", "0.75x", "--concurrency", "4"])
    with pytest.raises(LookupError, match="no closed-loop peak of chat from http"):
        LB.resolve_rate(args, "chat", 0.75)
    args.peaks["chat"] = 0.8
    rate, why = LB.resolve_rate(args, "chat", 0.75)
    assert rate == pytest.approx(0.6) and why == "0.75x http peak 0.8 req/s"


@pytest.mark.parametrize("argv, message", [
    (["--rates", "0.75x", "--concurrency", ""], "give --concurrency too"),
    (["--rates", "0.75x", "--concurrency", "4", "--systems", "region-cache"], "--rate-reference"),
    (["--rates", "0x", "--concurrency", "4"], "rates must be > 0"),
])
def test_relative_rates_refuse_what_cannot_be_scaled(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LB.resolve_args(["--size", "smoke", *argv])
    assert message in capsys.readouterr().err


def test_the_h200_size_is_the_acceptance_point() -> None:
    args = LB.resolve_args(["--size", "h200"])
    assert args.workload_list == ["chat", "rag"] and args.rel_rate_list == [0.75]
    assert args.concurrency_list and args.budget <= 600


def test_nixl_rows_name_their_ucx_transports() -> None:
    """nixl is UCX over TCP (the network stand-in), nixl-local over shared memory and, on a
    GPU, cuda_ipc; both add cuda_copy on a GPU (NIXL's UCX backend needs it for VRAM)."""
    from tract_async.loadtest.runner import SYSTEMS, ucx_env
    rows = {s.name: s for s in SYSTEMS}
    assert ucx_env(rows["nixl"], "cpu") == {"UCX_TLS": "tcp"}
    assert ucx_env(rows["nixl"], "cuda") == {"UCX_TLS": "tcp,cuda_copy"}
    assert ucx_env(rows["nixl-local"], "cpu") == {"UCX_TLS": "shm,tcp"}
    assert ucx_env(rows["nixl-local"], "cuda:0") == {"UCX_TLS": "shm,tcp,cuda_copy,cuda_ipc"}
    assert ucx_env(rows["region-transfer"], "cuda") == {}

"""Rack role options: per-role service settings (the bench puts prefill and decode on separate
GPUs with them)."""
from __future__ import annotations

import pytest

from tract_async.serving.launcher import Rack


def test_role_options_override_one_role_only(tmp_path) -> None:  # noqa: ANN001
    rack = Rack(mode="http", region=None, log_dir=str(tmp_path), model="tiny", device="cpu",
                role_options={"decode": {"device": "cuda:1"}})
    assert rack._cfg("prefill", node_id=0).device == "cpu"
    assert rack._cfg("decode", node_id=1).device == "cuda:1"   # not started: no GPU needed
    router = rack._cfg("router", prefill_url="http://127.0.0.1:1", decode_url="http://127.0.0.1:2")
    assert router.device == "cpu"


def test_role_options_refuse_an_unknown_role(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="unknown roles"):
        Rack(mode="http", region=None, log_dir=str(tmp_path), role_options={"decoder": {}})

"""``python -m tract_async.serving ROLE [options]``: run one service (prefill, decode, router).

What the launcher (and ``tract demo``) starts as separate processes; see ``--help`` for the
options and :mod:`tract_async.serving.service` for the life cycle (ready line, signals).
"""
from __future__ import annotations

import argparse
import gc
import sys

from tract_async.serving.service import add_arguments, config_from_args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tract_async.serving",
                                description="run one tract serving process")
    add_arguments(p)
    cfg = config_from_args(p.parse_args(argv))
    import tract_async as tract
    from tract_async.serving.service import serve
    if cfg.role == "prefill":
        from tract_async.serving.prefill_worker import build_app, ready_info
    elif cfg.role == "decode":
        from tract_async.serving.decode_worker import build_app, ready_info
    else:
        from tract_async.serving.router import build_app, ready_info
    tract.run(serve(build_app(cfg), cfg, ready_info=ready_info))
    return 0


if __name__ == "__main__":
    status = main()
    # The service has stopped and cleaned up (engine, agent, region mapping, tasks). What is
    # left is the interpreter's teardown, whose collections walk every object torch and
    # transformers made, several times: 0.5-2 s per worker process on the 2-core VM, and a
    # rack stops its workers one after the other. Frozen objects are left to the exit
    # (reference counting still frees what the teardown drops; only cyclic garbage is not
    # chased, and nothing of the service needs a finalizer to run by then).
    gc.freeze()
    sys.exit(status)

"""The load benchmark (``tract bench serve``), writing under ``bench/results/``.

    python bench/serve_load.py --size cpu          # the README's CPU run (tiny model, 2 cores)
    python bench/serve_load.py --size h200         # Llama-3-8B geometry on one GPU, at 0.75x http's peak
    python bench/serve_load.py --size smoke --systems http,region-cache

Every option of ``tract bench serve --help``; only the default output folder differs:
``bench/results/serve-load-<size>-<time>/`` (results.json, summary.md, plots, service logs).
"""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tract_async.loadtest.runner import main  # noqa: E402


def default_out_dir(argv: list[str]) -> str:
    size = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--size"), "smoke")
    size = next((a.split("=", 1)[1] for a in argv if a.startswith("--size=")), size)
    return os.path.join(HERE, "results", time.strftime(f"serve-load-{size}-%Y%m%d-%H%M%S"))


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--out-dir" or a.startswith("--out-dir=") for a in argv):
        argv += ["--out-dir", default_out_dir(argv)]
    sys.exit(main(argv))

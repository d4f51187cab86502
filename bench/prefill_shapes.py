"""What a prefill of a first-seen prompt length costs, per SDPA backend choice (issue 38).

    python bench/prefill_shapes.py                      # a GPU host: Llama-3-8B geometry, bf16
    python bench/prefill_shapes.py --smoke              # the CPU: a tiny model, to check the code

A serving worker meets a new prompt length on nearly every request (and a new (query, key)
length pair with every prefix-hit length). In the H100 serving runs of 2026-12-06 the prefill's
computing thread lost 40-70 ms between layers 0 and 1 on half the requests and 0.8-1.1 s on the
first prefix hits (``bench/layer_gaps.py`` on ``bench/results/gpu-20261206-s41``), which points
at a per-shape build step in attention: cuDNN's SDPA builds a graph per shape. This measures
it directly: for each ``--backends`` choice (``default``: PyTorch's own, cuDNN allowed;
``no-cudnn``: what the serving workers use, ``serving.model.allow_cudnn_attention(False)``) and
each prompt length (fresh lengths per choice, so that no cache carries over), two prefills in a
row: the host time from layer 0's K/V to layer 1's (the gap the serving timelines showed) and
the whole prefill's time, first call and second call; then the same with a prefix (a hit) of
``--hit-tokens``. The choices run in the order given and then the first again (a control for
order effects). Prints a table, writes ``<out-dir>/prefill-shapes-<time>-<commit>.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
from _common import RESULTS_DIR, leave_path, machine, table  # noqa: E402
leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import torch  # noqa: E402

LENGTHS = [646, 3795, 5023, 5956, 6138, 7410]    # the rag workload's prompt lengths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["default", "no-cudnn"],
                   choices=["default", "no-cudnn"])
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    p.add_argument("--hit-tokens", type=int, nargs="+", default=[32, 4800])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, short prompts")
    p.add_argument("--out-dir", default=RESULTS_DIR)
    a = p.parse_args(argv)
    from tract_async.serving.model import (allow_cudnn_attention, build_model, llama3_8b_config,
                                           prefill, tiny_llama_config)
    if a.smoke:
        device, dtype, cfg = "cpu", torch.float32, tiny_llama_config(num_layers=4)
        a.lengths, a.hit_tokens = [40, 56, 72], [16]
    elif not torch.cuda.is_available():
        print("prefill_shapes needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    else:
        device, dtype, cfg = "cuda", torch.bfloat16, llama3_8b_config()
    model = build_model(cfg, 0, device, dtype, init_device=device, attn="sdpa")
    print(f"{torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}",
          flush=True)
    vocab = model.config.vocab_size
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run(n: int, past_kv: Any = None, past: int | None = None) -> tuple[float, float, Any]:
        stamps: dict[int, float] = {}

        def on_layer(i: int, kv: Any) -> None:
            stamps.setdefault(i, time.perf_counter())
        ids = [(i * 7919 + n) % vocab for i in range(n)]
        sync()
        t0 = time.perf_counter()
        r = prefill(model, ids, past_kv=past_kv, past_len=past, on_layer=on_layer)
        sync()
        return (stamps[1] - stamps[0]) * 1e3, (time.perf_counter() - t0) * 1e3, r

    run(a.lengths[0] // 2)
    run(a.lengths[0] // 2)                        # the process warm: kernels, allocator
    rows: list[dict[str, Any]] = []
    order = a.backends + [a.backends[0]]
    for k, backend in enumerate(order):
        allow_cudnn_attention(backend == "default") if device == "cuda" else None
        shift = k + 1                             # fresh lengths for every pass
        for n0 in a.lengths:
            n = n0 + shift
            f, s = run(n), run(n)
            rows.append({"pass": k, "backend": backend, "tokens": n, "hit": 0,
                         "gap01_first_ms": f[0], "gap01_second_ms": s[0],
                         "total_first_ms": f[1], "total_second_ms": s[1]})
            print(table(rows[-1:], list(rows[-1])), flush=True)
        n = a.lengths[-1] + shift
        full = run(n)[2]
        for hit in a.hit_tokens:
            if hit >= n:
                continue
            pk = full.kv[:, :, :hit].contiguous()
            f, s = run(n, pk, hit), run(n, pk, hit)
            rows.append({"pass": k, "backend": backend, "tokens": n, "hit": hit,
                         "gap01_first_ms": f[0], "gap01_second_ms": s[0],
                         "total_first_ms": f[1], "total_second_ms": s[1]})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    allow_cudnn_attention(True) if device == "cuda" else None
    info = machine()
    commit = info.get("git") or "unknown"   # TRACT_GIT_COMMIT where the tree has no .git
    card = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print("\n" + table(rows, list(rows[0])))
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, time.strftime("prefill-shapes-%Y%m%d-%H%M%S-") + commit + ".json")
    import json
    with open(path, "w") as f:
        json.dump({"machine": info, "card": card, "commit": commit, "torch": torch.__version__,
                   "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                   "smoke": a.smoke, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

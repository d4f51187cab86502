"""How fast the serving workers' model runs on the GPU: prefill TFLOP/s and decode TPOT.

    python bench/model_speed.py                       # Llama-3-8B geometry, random bf16 weights
    python bench/model_speed.py --tokens 4096 8192 --attn eager sdpa --batches 1 4 8

Issue 38's acceptance beside the serving harness: prefill of 4K and 8K tokens at >= 40 % of the
card's dense bf16 peak, and decode TPOT at batch 1 <= 2x the weight-read floor. Measured in the
same run, so the ratios hold on a noisy host:

* the HBM bandwidth (a device-to-device copy of 4 GiB: read + write bytes over time), and from it
  the floor of one decode step: every weight a step reads (all but the embedding table) over that
  bandwidth;
* prefill (``serving.model.prefill``, last-position logits only, no per-layer host sync) of each
  ``--tokens`` with each ``--attn`` implementation (``sdpa``: as the serving workers run it,
  cuDNN's attention off, ``serving.model.allow_cudnn_attention``; ``sdpa-cudnn``: PyTorch's
  default choice, cuDNN allowed; each length warmed once first): median time, model FLOPs (2 x linear
  parameters x tokens, plus causal attention 2 x T^2 x heads x head_dim per layer) over time,
  and that over the card's dense bf16 peak (a table by device name; ``--peak-tflops`` overrides);
* decode TPOT after a ``--context`` token prompt: transformers' own step (``greedy_continue``,
  batch 1) and, with ``--batches``, the serving decoder's batched step
  (``serving.fast_decode``) with and without CUDA graphs, per batch size.

Prints a table and writes ``<out-dir>/<name>.json`` with the machine, the card and the commit.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS_DIR, leave_path, machine, table  # noqa: E402
leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import torch  # noqa: E402

#: Dense (no sparsity) bf16 tensor-core peak in TFLOP/s, from NVIDIA's data sheets.
BF16_PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4, "H200": 989.4, "H800": 989.4,
    "A100": 312.0, "L40S": 362.0,
}


def card_peak(name: str) -> float | None:
    """The peak of the first table entry whose key is in the device name (longest key first)."""
    for key in sorted(BF16_PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return BF16_PEAK_TFLOPS[key]
    return None


def cuda_time(fn: Any, reps: int) -> list[float]:
    """Seconds per call of ``fn`` (synchronized before and after each), ``reps`` times."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def hbm_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy, read and write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = statistics.median(cuda_time(lambda: dst.copy_(src), 5))
    return 2 * nbytes / t


def linear_params(model: Any) -> int:
    """Parameters of the per-token matmuls of a prefill (layers only: the lm_head runs for the
    last position alone)."""
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith("model.layers.") and p.dim() == 2)


def step_weight_bytes(model: Any) -> int:
    """Bytes a decode step reads from weights: everything but the embedding table (one row)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "embed_tokens" not in n)


def prefill_flops(model: Any, tokens: int) -> float:
    cfg = model.config
    attn = 2.0 * tokens * tokens * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 2.0 * linear_params(model) * tokens + attn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--attn", nargs="+", default=["eager", "sdpa", "sdpa-cudnn"],
                   choices=["eager", "sdpa", "sdpa-cudnn"])
    p.add_argument("--context", type=int, default=2048, help="prompt tokens before decode steps")
    p.add_argument("--steps", type=int, default=48, help="decode steps timed")
    p.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8],
                   help="batch sizes of the serving decoder (none: only transformers' step)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("model_speed needs a CUDA device", file=sys.stderr)
        return 2
    import json
    from tract_async.serving.model import (allow_cudnn_attention, build_model, greedy_continue,
                                           llama3_8b_config, prefill)

    def use(attn: str) -> None:
        """The attention variant ``attn`` on the model (and cuDNN's SDPA on or off)."""
        model.config._attn_implementation = "eager" if attn == "eager" else "sdpa"
        allow_cudnn_attention(attn == "sdpa-cudnn")
    from tract_async.serving.kv_cache import build_cache

    info = machine()
    gpu = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or card_peak(gpu)
    bw = hbm_bandwidth()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    model = build_model(llama3_8b_config(), 0, "cuda", torch.bfloat16, init_device="cuda",
                        attn="sdpa")
    build_s = time.perf_counter() - t0
    wbytes = step_weight_bytes(model)
    floor_ms = wbytes / bw * 1e3
    print(f"{gpu}: HBM {bw / 1e12:.2f} TB/s, step weights {wbytes / 1e9:.2f} GB, "
          f"floor {floor_ms:.2f} ms/step, peak {peak} TFLOP/s, model built in {build_s:.1f} s",
          flush=True)
    gen = torch.Generator().manual_seed(1)
    rows: list[dict[str, Any]] = []
    for attn in args.attn:
        use(attn)
        for tokens in args.tokens:
            ids = torch.randint(0, 128000, (tokens,), generator=gen).tolist()
            try:
                prefill(model, ids)   # warm-up (kernels, allocator)
                times = cuda_time(lambda: prefill(model, ids), args.reps)
            except torch.OutOfMemoryError as exc:
                rows.append({"what": "prefill", "attn": attn, "tokens": tokens,
                             "error": f"OOM: {exc}"[:200]})
                torch.cuda.empty_cache()
                continue
            med = statistics.median(times)
            tflops = prefill_flops(model, tokens) / med / 1e12
            rows.append({"what": "prefill", "attn": attn, "tokens": tokens, "ms": med * 1e3,
                         "tflops": tflops, "pct_peak": 100 * tflops / peak if peak else None,
                         "times_ms": [t * 1e3 for t in times]})
            print(table(rows[-1:], ["what", "attn", "tokens", "ms", "tflops", "pct_peak"]),
                  flush=True)
            torch.cuda.empty_cache()
    # transformers' own decode step, batch 1
    use("sdpa")
    ids = torch.randint(0, 128000, (args.context,), generator=gen).tolist()
    for attn in args.attn:
        use(attn)
        res = prefill(model, ids)
        cache = build_cache(model.config.num_hidden_layers, past_kv=res.kv)
        greedy_continue(model, cache, res.next_token, max_new_tokens=4, eos_token_id=None)
        cache = build_cache(model.config.num_hidden_layers, past_kv=res.kv)
        torch.cuda.synchronize()
        t = time.perf_counter()
        greedy_continue(model, cache, res.next_token, max_new_tokens=args.steps + 1,
                        eos_token_id=None)
        torch.cuda.synchronize()
        tpot = (time.perf_counter() - t) / args.steps * 1e3
        rows.append({"what": "decode-hf", "attn": attn, "batch": 1, "context": args.context,
                     "tpot_ms": tpot, "x_floor": tpot / floor_ms})
        print(table(rows[-1:], ["what", "attn", "batch", "context", "tpot_ms", "x_floor"]),
              flush=True)
    use("sdpa")
    try:
        from tract_async.serving import fast_decode
    except ImportError:
        fast_decode = None
    if fast_decode is not None and args.batches:
        rows += fast_decode.bench_rows(model, context=args.context, steps=args.steps,
                                       batches=args.batches, floor_ms=floor_ms)
    cols = ["what", "attn", "tokens", "batch", "context", "graphs", "ms", "tflops", "pct_peak",
            "tpot_ms", "x_floor"]
    print(table(rows, cols))
    name = args.name or (f"model-speed-{gpu.replace(' ', '_')}-{info.get('git', 'nogit')}-"
                         f"{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"{name}.json")
    with open(path, "x") as f:
        json.dump({"machine": info, "gpu": gpu, "peak_bf16_tflops": peak, "hbm_bytes_per_s": bw,
                   "step_weight_bytes": wbytes, "floor_ms": floor_ms, "argv": sys.argv[1:],
                   "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Layer pipelining on a random-weight Llama-3-8B (bf16, transformers eager) on one GPU.

1. Prefill of 1K..8K tokens: ``prefill`` alone, ``prefill_streaming`` with a no-op put, and
   ``prefill_streaming`` whose ``put_layer(i)`` stores layer i in the region through the engine
   (``start_put_kv(..., layer=i, ready=<event recorded after layer i's attention>)``), so the
   DMA of layer i overlaps the compute of layer i+1. ``put_layer`` returns once the put is
   reserved and enqueued; the prefill's time includes awaiting every layer's publication at the
   end. (Until 2026-11-30 each layer's StreamFuture was awaited inside ``put_layer``: layers
   were then published one after another, each paying the future's completion latency, ~0.3 ms,
   which at 1K tokens (~1.5 ms of compute per layer) made puts 1.5-2.2x the prefill.)
   Target: with puts <= 1.03 x prefill alone.
2. Timeline (one prompt): prefill with layer-wise puts and ``decode_streaming`` started together
   (the first token taken from an earlier identical prefill); the decode's ``get_layer`` is a
   LayerPrefetcher (reads 2 layers ahead, each waiting for its layer to be published). Shown:
   when each layer was published and when decode got it; the first decode step starts (layer 0
   in hand) long before the last layer lands. Both share one GPU and its default stream, so the
   decode's kernels queue behind the prefill's: the host timeline is what this shows.
Writes bench/results/gpu_pipeline-<time>-<commit>.json (with an NVML time series of the timeline run).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import leave_path, llama_layout, median, table, write_json  # noqa: E402
leave_path()  # bench/kernels.py shadows transformers' `kernels` (_common)

import tract_async as tract  # noqa: E402

RESULTS: dict = {}


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeline-tokens", type=int, default=4096)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--name", default="gpu_pipeline")
    ap.add_argument("--switch-interval-us", type=float, default=None,
                    help="sys.setswitchinterval for this run (diagnostic: the prefill compute "
                         "thread and the loop thread that puts each layer share the GIL; the "
                         "default 5 ms interval lets a CPU-bound compute thread hold it that long)")
    args = ap.parse_args()
    if args.switch_interval_us is not None:
        sys.setswitchinterval(args.switch_interval_us * 1e-6)
    RESULTS["switch_interval_s"] = sys.getswitchinterval()
    if not torch.cuda.is_available():
        print("gpu_pipeline: no CUDA device; nothing to measure")
        return 0
    deadline = time.monotonic() + args.budget_s
    from tract_async.cuda.pipeline import LayerEvents, LayerPrefetcher
    from tract_async.serving.model import build_model, llama3_8b_config, prefill
    from tract_async.serving.streaming import decode_streaming, prefill_streaming

    t0 = time.perf_counter()
    cfg = llama3_8b_config()
    model = build_model(cfg, seed=0, device="cuda", dtype=torch.bfloat16, init_device="cuda")
    torch.cuda.synchronize()
    RESULTS["model_build_s"] = time.perf_counter() - t0
    RESULTS["gpu"] = torch.cuda.get_device_name(0)
    RESULTS["args"] = vars(args)
    lay = llama_layout()
    path = f"/dev/shm/tract-bench-pipe-{os.getpid()}"
    ecfg = tract.EngineConfig(region=path, region_bytes=(max(args.tokens) * 128 << 10) + (384 << 20),
                              create=True, layout=lay, mode="transfer", namespace="bench-pipe")
    rows = []
    try:
        async with tract.Engine.open(ecfg) as eng:
            eng.cuda_setup()
            events = LayerEvents(model)

            async def noop(i, kv, ready=None):
                return None

            def make_put(keys, log=None):
                """put_layer for prefill_streaming: start the layer's put (reserve + enqueue
                the DMA after the layer's attention event) and return; the DMA and its
                publication run while the next layers compute. ``put_layer.drain()`` awaits
                every publication (the timings below include it)."""
                futs = {}

                async def put_layer(i, kv, ready=None):
                    ev = await events.event(i)
                    futs[i] = await eng.start_put_kv(keys, kv, layer=i, ready=ev)

                async def drain():
                    await asyncio.gather(*futs.values())
                    if log is not None:
                        for i, f in futs.items():
                            log[i] = f.t_completed
                put_layer.drain = drain
                return put_layer

            async def prefill_with_puts(ids, keys, log=None):
                put = make_put(keys, log)
                await prefill_streaming(model, ids, put_layer=put)
                await put.drain()

            # warm-up: kernels, Triton/Numba JIT, the allocator
            warm = prompt(1024, 999, cfg.vocab_size)
            prefill(model, warm)
            wkeys = eng.block_keys(warm)
            events.reset()
            await prefill_with_puts(warm, wkeys)
            await eng.get_kv(wkeys, device="cuda")              # consume
            torch.cuda.synchronize()

            for n in args.tokens:
                if time.monotonic() > deadline:
                    break
                alone, stream_noop, with_puts = [], [], []
                for r in range(args.reps):
                    ids = prompt(n, n * 100 + r, cfg.vocab_size)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    prefill(model, ids)
                    torch.cuda.synchronize()
                    alone.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    await prefill_streaming(model, ids, put_layer=noop)
                    torch.cuda.synchronize()
                    stream_noop.append(time.perf_counter() - t)
                    keys = eng.block_keys(ids)
                    events.reset()
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    await prefill_with_puts(ids, keys)
                    torch.cuda.synchronize()
                    with_puts.append(time.perf_counter() - t)
                    if r == 0:   # the stored KV is the prefill's KV, bit for bit
                        ref = prefill(model, ids).kv
                        got = await eng.get_kv(keys, device="cuda")   # (consumes)
                        same = torch.equal(got.view(torch.int16), ref.view(torch.int16))
                    else:
                        await eng.get_kv(keys, device="cuda")
                row = {"tokens": n, "prefill_ms": median(alone) * 1e3,
                       "streaming_noop_ms": median(stream_noop) * 1e3,
                       "with_puts_ms": median(with_puts) * 1e3,
                       "kv_mib": n * 128 / 1024, "stored_kv_exact": same}
                row["ratio_vs_prefill"] = row["with_puts_ms"] / row["prefill_ms"]
                row["ratio_vs_streaming"] = row["with_puts_ms"] / row["streaming_noop_ms"]
                rows.append(row)
                print(f"prefill {n:>5} tokens: alone {row['prefill_ms']:.1f} ms, streaming "
                      f"{row['streaming_noop_ms']:.1f}, with puts {row['with_puts_ms']:.1f} "
                      f"(x{row['ratio_vs_prefill']:.3f}; KV exact: {same})", flush=True)
                RESULTS["prefill"] = rows
                write_json(args.name, RESULTS)
            print(table(rows, ["tokens", "prefill_ms", "streaming_noop_ms", "with_puts_ms",
                               "ratio_vs_prefill", "ratio_vs_streaming", "stored_kv_exact"]),
                  flush=True)

            # -- timeline: prefill with puts and decode together ---------------------------
            if args.timeline_tokens > 0 and time.monotonic() < deadline + 30:
                n = args.timeline_tokens
                ids = prompt(n, 4242, cfg.vocab_size)
                first = prefill(model, ids).next_token
                keys = eng.block_keys(ids)
                sampler = eng.start_telemetry(interval_s=0.02)
                published: dict[int, float] = {}
                events.reset()
                torch.cuda.synchronize()
                base = time.perf_counter()
                sampler.mark("start")
                async with LayerPrefetcher(eng, keys, lay.num_layers, depth=2,
                                           timeout=60) as get_layer:
                    async def run_decode():
                        toks = await decode_streaming(model, get_layer, n, first,
                                                      max_new_tokens=4, layer_timeout=60)
                        return toks, time.perf_counter()

                    async def run_prefill():
                        await prefill_with_puts(ids, keys, published)
                        return time.perf_counter()

                    t_prefill_done, (toks, t_decode_done) = await asyncio.gather(
                        run_prefill(), run_decode())
                    tl = get_layer.timeline
                torch.cuda.synchronize()
                sampler.mark("end")
                await asyncio.sleep(0.1)
                await eng.stop_telemetry()
                from tract_async.serving.model import decode
                ref_toks = decode(model, prefill(model, ids).kv, n, first_token=first,
                                  max_new_tokens=4)
                await eng.get_kv(keys, device="cuda")            # consume
                rel = lambda t: None if t is None else round((t - base) * 1e3, 3)  # noqa: E731
                layers = [{"layer": i, "attn_event_ms": rel(events.recorded_at.get(i)),
                           "published_ms": rel(published.get(i)),
                           "decode_asked_ms": rel(tl.get(i, {}).get("asked")),
                           "decode_enqueued_ms": rel(tl.get(i, {}).get("enqueued")),
                           "decode_validated_ms": rel(tl.get(i, {}).get("validated"))}
                          for i in range(lay.num_layers)]
                last_pub = max(published.values())
                first_got = tl[0]["validated"]
                RESULTS["timeline"] = {
                    "tokens": n, "layers": layers,
                    "prefill_done_ms": rel(t_prefill_done), "decode_done_ms": rel(t_decode_done),
                    "last_layer_published_ms": rel(last_pub),
                    "decode_layer0_in_hand_ms": rel(first_got),
                    "decode_started_before_last_layer_landed": first_got < last_pub,
                    "decode_tokens": toks, "reference_tokens": ref_toks,
                    "tokens_match": toks == ref_toks,
                    "telemetry": {"series": sampler.series(), "marks": sampler.marks,
                                  "summary": sampler.summary()}}
                print(table(layers, list(layers[0].keys())), flush=True)
                print(f"timeline {n} tokens: decode had layer 0 at {rel(first_got)} ms, last "
                      f"layer published at {rel(last_pub)} ms -> decode started before the last "
                      f"layer landed: {first_got < last_pub}; tokens match reference: "
                      f"{toks == ref_toks}", flush=True)
            events.close()
            RESULTS["engine_cuda_stats"] = eng.stats()["cuda"]
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        print("wrote", write_json(args.name, RESULTS))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

"""Start a disaggregated rack (prefill, decode, router: three processes on 127.0.0.1, one /dev/shm
region) and chat with it through the OpenAI-style API.

    python examples/disaggregated_chat.py [http|region-transfer|region-cache]

To adapt: the services are ``python -m tract_async.serving {prefill,decode,router} --help``
(see examples/run_services.sh); ``Rack(...)`` takes any ``ServiceConfig`` field as a keyword
(``model="llama3-8b", device="cuda", dtype="bfloat16"`` for the 8B geometry on a GPU).
"""
from __future__ import annotations

import os
import sys

import aiohttp

import tract_async as tract
from tract_async.serving.launcher import Rack
from tract_async.serving.tokenizer import ByteTokenizer


async def main(mode: str) -> None:
    tok = ByteTokenizer()
    region = f"/dev/shm/tract-example-{os.getpid()}"
    async with Rack(mode=mode, region=region, log_dir="/tmp/tract-example-logs",
                    torch_threads=1) as rack, aiohttp.ClientSession() as http:
        history = tok.encode("<|system|>\nYou are a terse assistant.<|end|>\n")
        for question in ("What is a KV cache?", "Why share it across a rack?", "Thanks!"):
            history += tok.encode(f"<|user|>\n{question}<|end|>\n<|assistant|>\n", add_bos=False)
            async with http.post(f"{rack.router_url}/v1/completions",
                                 json={"prompt": history, "max_tokens": 12}) as r:
                body = await r.json()
            reply = body["choices"][0]["token_ids"]
            t = body["tract"]
            print(f"{question!r:35} -> {len(reply)} tokens; TTFT {t['ttft_ms']:.1f} ms, "
                  f"{t['hit_blocks']}/{t['full_blocks']} blocks from the prefix cache")
            history += reply + tok.encode("<|end|>\n", add_bos=False)
        async with http.get(f"{rack.router_url}/metrics") as r:
            print("\n".join(line for line in (await r.text()).splitlines()
                            if line.startswith("tract_ttft_seconds_count")))


if __name__ == "__main__":
    tract.run(main(sys.argv[1] if len(sys.argv) > 1 else "region-cache"))

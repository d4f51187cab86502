"""Batched greedy decode steps over a static KV cache, replayed as CUDA graphs on a GPU.

Why not transformers' own step: on the H100 its decode step of the Llama-3-8B geometry took
36.5 ms (eager attention) and 84 ms (SDPA) at batch 1 against a weight-read floor of 5.0 ms
(``bench/results/gpu-20261206-s39/call1-model-speed-h100-fd2819f.json``): the step is host-bound
(hundreds of kernel launches from Python, a cache that concatenates every step) and serves one
request at a time, so a decode worker with a queue makes every queued request wait for whole
generations (issue 38). This module keeps the model's weights and modules and replaces only the
step:

* **Static cache.** K and V of every layer live in two tensors
  ``(num_layers, max_batch, kv_heads, max_len, head_dim)`` (transformers' head-major order, so a
  layer of a slot is one strided view); a request occupies one *slot* from its first generated
  token to its last. Active requests always hold slots ``0 .. B-1`` (a finished one's slot is
  refilled by moving the last slot into it), so a step of B requests reads a prefix of the
  batch axis.
* **One step, many requests.** The matmuls of a step (the weight reads that set its floor) run
  once for the batch; attention runs per request over its own length, masked within a bucket of
  the cache (``bucket(len)``: a power of two from 256, at most ``max_len``), with the query
  heads grouped by KV head so K and V are read once, not repeated per query head.
* **CUDA graphs.** On a GPU each ``(batch bucket, length bucket)`` is captured once, on first use,
  into one memory pool, and replayed: a step is then one launch instead of ~500.

The arithmetic is transformers' eager Llama step (its RMSNorm, projections, MLP and rotary
modules are called as they are; RoPE, the fp32 softmax and the masking follow
``eager_attention_forward``), so tokens equal :func:`~tract_async.serving.model.reference_generate`
up to the few-ulp differences a GEMM gives for another row count (``serving/model.py``,
Numerics).
"""
from __future__ import annotations

from typing import Any

import torch

#: The shortest attention span a step is built for; longer spans double from it.
MIN_BUCKET = 256
#: The batch sizes a step is built for (a batch of 3 runs the step of 4 with a row idle).
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
#: Token counts an extend (a request's first pass after its transferred blocks: the partial
#: last block and the last prompt token) is built for; a longer tail takes transformers' pass.
EXTEND_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16)


def bucket(n: int, *, minimum: int = MIN_BUCKET) -> int:
    """The smallest power-of-two multiple of ``minimum`` that is >= ``n``."""
    b = minimum
    while b < n:
        b *= 2
    return b


class DecodeCapacityError(ValueError):
    """A request does not fit the decoder (too long for ``max_len``, or no free slot)."""


class BatchDecoder:
    """Greedy steps for up to ``max_batch`` requests of up to ``max_len`` tokens each.

    Not thread-safe: one thread (the decode worker's compute thread) calls every method.

    Byte layout of the cache (device memory, not the region): ``k`` and ``v`` are each
    ``num_layers x max_batch x kv_heads x max_len x head_dim`` elements of the model's dtype,
    row-major; slot ``s``'s token ``t`` of layer ``l`` and head ``h`` is at
    ``[l, s, h, t, :]``. ``lens[s]`` tokens of slot ``s`` are valid.
    """

    def __init__(self, model: Any, *, max_batch: int, max_len: int,
                 graphs: bool | None = None) -> None:
        cfg = model.config
        if max_batch < 1 or max_len < 2:
            raise ValueError(f"max_batch must be >= 1 and max_len >= 2, got {max_batch}, {max_len}")
        self.model = model
        self.num_layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.groups = self.heads // self.kv_heads
        self.scaling = self.head_dim ** -0.5
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_batch = max_batch
        self.max_len = -(-max_len // MIN_BUCKET) * MIN_BUCKET    # whole buckets of the smallest
        shape = (self.num_layers, max_batch, self.kv_heads, self.max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.lens = [0] * max_batch
        self.active = 0                      # slots 0 .. active-1 hold requests
        self.graphs = (self.device.type == "cuda") if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        # static inputs and output of the step (graph capture reads and writes these)
        self._tok = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._out = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._rows = torch.arange(max_batch, device=self.device)
        ne = EXTEND_BUCKETS[-1]
        self._etok = torch.zeros(ne, dtype=torch.long, device=self.device)
        self._epos = torch.zeros(ne, dtype=torch.long, device=self.device)
        self._eslot = torch.zeros(1, dtype=torch.long, device=self.device)
        self._elast = torch.zeros(1, dtype=torch.long, device=self.device)
        hidden = cfg.hidden_size
        # the tail's hidden state: layer i reads _eh[i % 2] and writes _eh[(i + 1) % 2], so that
        # running a layer twice (a capture's warm-up) gives the same result as once
        self._eh = torch.zeros(2, ne, hidden, dtype=self.dtype, device=self.device)
        self._ecos = torch.zeros(ne, 1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        self._esin = torch.zeros_like(self._ecos)
        self._emask = torch.zeros(1, ne, 1, self.max_len, dtype=self.dtype, device=self.device)
        self._stream: tuple[int, int, int, int, int] | None = None   # slot, past, n, nb, span
        self._spans = torch.arange(self.max_len, device=self.device)
        self._captured: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        # a blocking-sync event: waiting on it sleeps and releases the GIL (wait_for_gpu)
        self._done = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        self.captures = 0
        self.extends = 0                     # first passes run here (admit_extend)
        self.streams = 0                     # ... of which layer by layer (stream_*)

    @property
    def cache_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def free_slots(self) -> int:
        return self.max_batch - self.active

    # --- slots -----------------------------------------------------------------------------
    def admit(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copy a request's KV (per layer ``(keys, values)``, each ``(1, kv_heads, n, head_dim)``:
        a transformers cache layer after the request's first forward pass) into the next free
        slot; returns the slot. Raises DecodeCapacityError when no slot is free or ``n`` leaves
        no room to generate."""
        if self.active >= self.max_batch:
            raise DecodeCapacityError(f"all {self.max_batch} decode slots are busy")
        n = int(layers[0][0].shape[-2])
        if n >= self.max_len:
            raise DecodeCapacityError(f"a {n}-token context leaves no room in max_len {self.max_len}")
        s = self.active
        for i, (keys, values) in enumerate(layers):
            self.k[i, s, :, :n].copy_(keys[0])
            self.v[i, s, :, :n].copy_(values[0])
        self.lens[s] = n
        self.active += 1
        return s

    def admit_extend(self, past: list[torch.Tensor], past_len: int, tail: list[int]) -> int:
        """A request's first pass on the decoder: copy its transferred KV (per layer, engine
        layout ``(2, >= past_len, kv_heads, head_dim)``) into the next free slot, compute the
        ``tail`` tokens after it (the partial last block and the last prompt token; at most
        ``EXTEND_BUCKETS[-1]``) and return the first generated token. On a GPU that is one
        graph replay where transformers' pass costs 50-110 ms of Python launches once the KV
        is in hand (the H100 serving run at 3beb584). Raises DecodeCapacityError when no slot
        is free or the tail does not fit, ValueError for a tail outside the buckets."""
        s, nb, span = self._prepare_extend(past_len, tail)
        for i, kv in enumerate(past):
            self._copy_past(i, s, kv, past_len)
        self._run("extend", nb, span)
        return self._finish_extend(s, past_len + len(tail))

    def stream_begin(self, past_len: int, tail: list[int]) -> None:
        """Start an extend whose past arrives layer by layer: ``stream_layer(i, kv)`` for
        every layer in order, then ``stream_end()`` for the first token (or
        ``stream_abort()``). Each layer is one graph replay on a GPU, so when the last layer
        lands only its own compute and the logits are left (~1 ms), where a whole extend
        waits for every layer; the slot is reserved until the end or the abort. Raises as
        :meth:`admit_extend`."""
        if self._stream is not None:
            raise RuntimeError("an extend is already streaming")
        s, nb, span = self._prepare_extend(past_len, tail)
        self._stream = (s, past_len, len(tail), nb, span)
        self._run("xpro", nb, span)

    def stream_layer(self, i: int, kv: torch.Tensor) -> None:
        if self._stream is None:
            raise RuntimeError("no extend is streaming")
        s, past_len, _, nb, span = self._stream
        self._copy_past(i, s, kv, past_len)
        self._run(f"xlayer{i}", nb, span)

    def stream_end(self) -> int:
        if self._stream is None:
            raise RuntimeError("no extend is streaming")
        s, past_len, n, nb, _ = self._stream
        self._stream = None
        self._run("xhead", nb, 0)
        self.streams += 1
        return self._finish_extend(s, past_len + n)

    def stream_abort(self) -> None:
        """Forget a streaming extend (its slot was never made active)."""
        self._stream = None

    def _prepare_extend(self, past_len: int, tail: list[int]) -> tuple[int, int, int]:
        n = len(tail)
        if not 1 <= n <= EXTEND_BUCKETS[-1]:
            raise ValueError(f"an extend takes 1..{EXTEND_BUCKETS[-1]} tokens, got {n}")
        if self.active >= self.max_batch:
            raise DecodeCapacityError(f"all {self.max_batch} decode slots are busy")
        nb = next(x for x in EXTEND_BUCKETS if x >= n)
        if past_len + nb >= self.max_len:
            raise DecodeCapacityError(f"a {past_len + n}-token context leaves no room in "
                                      f"max_len {self.max_len}")
        s = self.active
        host_tok = torch.zeros(nb, dtype=torch.long)
        host_tok[:n] = torch.tensor(tail, dtype=torch.long)
        self._etok[:nb].copy_(host_tok)
        self._epos[:nb].copy_(torch.arange(past_len, past_len + nb, dtype=torch.long))
        self._eslot.fill_(s)
        self._elast.fill_(n - 1)
        return s, nb, min(bucket(past_len + nb), self.max_len)

    def _copy_past(self, i: int, s: int, kv: torch.Tensor, past_len: int) -> None:
        self.k[i, s, :, :past_len].copy_(kv[0, :past_len].transpose(0, 1))
        self.v[i, s, :, :past_len].copy_(kv[1, :past_len].transpose(0, 1))

    def _finish_extend(self, s: int, length: int) -> int:
        self._wait()
        token = int(self._out[0].item())
        self.extends += 1
        self.lens[s] = length
        self.active += 1
        return token

    def room(self, slot: int) -> int:
        """How many more tokens slot ``slot`` can take."""
        return self.max_len - self.lens[slot]

    def release(self, slot: int) -> int | None:
        """Free ``slot``; the last active slot moves into it. Returns the slot that moved (whose
        request now lives at ``slot``), or None."""
        last = self.active - 1
        if not 0 <= slot <= last:
            raise IndexError(f"slot {slot} is not active (active {self.active})")
        moved = None
        if slot != last:
            n = self.lens[last]
            self.k[:, slot, :, :n].copy_(self.k[:, last, :, :n])
            self.v[:, slot, :, :n].copy_(self.v[:, last, :, :n])
            self.lens[slot] = n
            moved = last
        self.lens[last] = 0
        self.active -= 1
        return moved

    # --- the step --------------------------------------------------------------------------
    def step(self, tokens: list[int]) -> list[int]:
        """One greedy step of every active request: ``tokens[s]`` is slot ``s``'s newest token
        (at position ``lens[s]``); returns each slot's next token and grows every slot by one."""
        b = self.active
        if len(tokens) != b or b == 0:
            raise ValueError(f"step needs one token per active slot ({b}), got {len(tokens)}")
        for s in range(b):
            if self.lens[s] >= self.max_len:
                raise DecodeCapacityError(f"slot {s} is full ({self.max_len} tokens)")
        bb = next(x for x in BATCH_BUCKETS + (self.max_batch,) if x >= b)
        bb = min(bb, self.max_batch)
        span = min(bucket(max(self.lens[:b]) + 1), self.max_len)
        host_tok = torch.zeros(bb, dtype=torch.long)
        host_tok[:b] = torch.tensor(tokens, dtype=torch.long)
        host_pos = torch.zeros(bb, dtype=torch.long)
        host_pos[:b] = torch.tensor(self.lens[:b], dtype=torch.long)
        self._tok[:bb].copy_(host_tok, non_blocking=False)
        self._pos[:bb].copy_(host_pos, non_blocking=False)
        self._run("step", bb, span)
        self._wait()
        out = self._out[:b].tolist()
        for s in range(b):
            self.lens[s] += 1
        return out

    def buckets(self, *, stream: bool = False) -> list[tuple[str, int, int]]:
        """Every ``(kind, rows, span)`` this decoder can run: kind ``step`` (rows: the batch)
        and ``extend`` (rows: the tail's tokens); with ``stream``, the parts of a streaming
        extend too (``xpro``, ``xlayer<i>``, ``xhead``)."""
        batches = sorted({min(x, self.max_batch) for x in BATCH_BUCKETS + (self.max_batch,)})
        spans: list[int] = []
        span = MIN_BUCKET
        while True:
            spans.append(min(span, self.max_len))
            if span >= self.max_len:
                break
            span *= 2
        out = ([("step", b, s) for b in batches for s in spans]
               + [("extend", n, s) for n in EXTEND_BUCKETS for s in spans if n < s])
        if stream:
            out += [("xpro", n, s) for n in EXTEND_BUCKETS for s in spans if n < s]
            out += [(f"xlayer{i}", n, s) for i in range(self.num_layers)
                    for n in EXTEND_BUCKETS for s in spans if n < s]
            out += [("xhead", n, 0) for n in EXTEND_BUCKETS]
        return out

    def capture_all(self, *, stream: bool = False) -> int:
        """Capture the step of every bucket now (a worker does it before it serves: a capture
        costs ~100 ms of the GPU on the 8B geometry, which would land on some request's
        TPOT). Returns how many were captured; a CPU decoder captures none."""
        if not self.graphs:
            return 0
        n = 0
        for key in self.buckets(stream=stream):
            if key not in self._captured:
                self._capture(*key)
                n += 1
        torch.cuda.synchronize(self.device)
        return n

    def _wait(self) -> None:
        """Wait for this thread's queued GPU work without the GIL (see :func:`wait_for_gpu`)."""
        if self._done is not None:
            self._done.record(torch.cuda.current_stream(self.device))
            self._done.synchronize()

    def _run(self, kind: str, rows: int, span: int) -> None:
        if self.graphs:
            self._replay(kind, rows, span)
        else:
            with torch.no_grad():
                self._part(kind)(rows, span)

    def _part(self, kind: str) -> Any:
        """The function a kind of graph captures, as ``fn(rows, span)``."""
        if kind == "step":
            return self._compute
        if kind == "extend":
            return self._compute_extend
        if kind == "xpro":
            return self._extend_prologue
        if kind == "xhead":
            return lambda rows, span: self._extend_head(rows)
        if kind.startswith("xlayer"):
            i = int(kind[len("xlayer"):])
            return lambda rows, span: self._extend_layer(i, rows, span)
        raise ValueError(f"unknown graph kind {kind!r}")

    def _replay(self, kind: str, rows: int, span: int) -> None:
        g = self._captured.get((kind, rows, span))
        if g is None:
            g = self._capture(kind, rows, span)
        g.replay()

    def _capture(self, kind: str, rows: int, span: int) -> torch.cuda.CUDAGraph:
        """Capture the step (or extend) of ``rows`` rows over ``span`` positions. The warm-up
        runs write K/V of the current inputs at the current positions, which the replay
        rewrites identically, and rows past the real ones only touch free slots or positions
        past a slot's length."""
        compute = self._part(kind)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):
                compute(rows, span)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # thread_local: the worker's other threads (the engine's copies and event queries on
        # the event loop) keep using CUDA while this thread captures; in the default global
        # mode their calls fail (cudaErrorStreamCaptureUnsupported) and void the capture, as
        # the first H100 serving run of the batcher showed
        with torch.no_grad(), torch.cuda.graph(g, pool=self._pool,
                                               capture_error_mode="thread_local"):
            compute(rows, span)
        self._captured[(kind, rows, span)] = g
        self.captures += 1
        return g

    def _compute(self, bb: int, span: int) -> None:
        """The step's arithmetic on the static buffers (no host sync, so it can be captured)."""
        m = self.model.model
        tok, pos, rows = self._tok[:bb], self._pos[:bb], self._rows[:bb]
        h = m.embed_tokens(tok)                                          # (bb, hidden)
        cos, sin = m.rotary_emb(h, pos[:, None])                         # (bb, 1, head_dim)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]                # (bb, 1, 1, d)
        mask = self._mask(pos, span)[:, None, None, :]                   # (bb, 1, 1, span)
        kvh, g, d = self.kv_heads, self.groups, self.head_dim
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            q = self._project(i, layer, h, cos, sin, rows, pos)          # (bb, kvh, g, d)
            keys = self.k[i, :bb, :, :span]                              # (bb, kvh, span, d)
            values = self.v[i, :bb, :, :span]
            scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling  # (bb, kvh, g, span)
            scores = scores + mask
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            o = torch.matmul(probs, values).reshape(bb, kvh * g * d)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = m.norm(h)
        logits = self.model.lm_head(h)
        self._out[:bb].copy_(torch.argmax(logits, dim=-1))

    def _mask(self, pos: torch.Tensor, span: int) -> torch.Tensor:
        """The additive mask of rows at positions ``pos`` over ``span`` cache positions: 0 up
        to each row's position, the dtype's minimum after (as eager attention's)."""
        allowed = self._spans[:span][None, :] <= pos[:, None]            # (rows, span)
        mask = torch.zeros((pos.shape[0], span), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask

    def _project(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s Q/K/V of rows ``h``, rotated; K and V stored into the cache at
        ``(slots[r], pos[r])``; returns Q grouped by KV head ``(rows, kv_heads, groups, d)``."""
        attn = layer.self_attn
        n, kvh, g, d = h.shape[0], self.kv_heads, self.groups, self.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(n, kvh, g, d)
        k = attn.k_proj(x).view(n, kvh, 1, d)
        v = attn.v_proj(x).view(n, kvh, d)
        q = q * cos + _rotate_half(q) * sin
        k = (k * cos + _rotate_half(k) * sin).view(n, kvh, d)
        self.k[i, slots, :, pos] = k
        self.v[i, slots, :, pos] = v
        return q

    def _compute_extend(self, nb: int, span: int) -> None:
        """``nb`` tokens of one slot (``_eslot``) at positions ``_epos``, causal among
        themselves and attending to the slot's cache; the logits of row ``_elast`` give
        ``_out[0]``. Rows past the tail's end compute unused values and write K/V past the
        slot's length, which later steps overwrite. The parts are separate so that a request
        whose KV is still arriving runs them layer by layer (``stream_*``)."""
        self._extend_prologue(nb, span)
        for i in range(self.num_layers):
            self._extend_layer(i, nb, span)
        self._extend_head(nb)

    def _extend_prologue(self, nb: int, span: int) -> None:
        """Embeddings, rotary angles and the causal mask of the tail into static buffers."""
        m = self.model.model
        tok, pos = self._etok[:nb], self._epos[:nb]
        h = m.embed_tokens(tok)                                          # (nb, hidden)
        cos, sin = m.rotary_emb(h, pos[None, :])                         # (1, nb, d)
        self._eh[0, :nb].copy_(h)
        self._ecos[:nb].copy_(cos[0][:, None, None, :])                  # (nb, 1, 1, d)
        self._esin[:nb].copy_(sin[0][:, None, None, :])
        self._emask[0, :nb, 0, :span].copy_(self._mask(pos, span))

    def _extend_layer(self, i: int, nb: int, span: int) -> None:
        """Layer ``i`` of the tail: its K/V into the slot, attention over the slot's first
        ``span`` positions, the MLP; hidden state from ``_eh[i % 2]`` to ``_eh[(i + 1) % 2]``."""
        layer = self.model.model.layers[i]
        attn = layer.self_attn
        h = self._eh[i % 2, :nb]
        cos, sin = self._ecos[:nb], self._esin[:nb]
        mask = self._emask[:, :nb, :, :span]                             # (1, nb, 1, span)
        slot = self._eslot
        kvh, g, d = self.kv_heads, self.groups, self.head_dim
        q = self._project(i, layer, h, cos, sin, slot.expand(nb), self._epos[:nb])
        keys = self.k[i, :, :, :span].index_select(0, slot)[0]         # (kvh, span, d)
        values = self.v[i, :, :, :span].index_select(0, slot)[0]
        qh = q.permute(1, 0, 2, 3).reshape(kvh, nb * g, d)
        scores = torch.matmul(qh, keys.transpose(1, 2)) * self.scaling  # (kvh, nb*g, span)
        scores = scores.view(kvh, nb, g, span) + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        o = torch.matmul(probs.view(kvh, nb * g, span), values)         # (kvh, nb*g, d)
        o = o.view(kvh, nb, g, d).permute(1, 0, 2, 3).reshape(nb, kvh * g * d)
        h = h + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        self._eh[(i + 1) % 2, :nb].copy_(h)

    def _extend_head(self, nb: int) -> None:
        """The last real row's logits -> ``_out[0]``."""
        h = self._eh[self.num_layers % 2, :nb]
        last = self.model.model.norm(h.index_select(0, self._elast))
        self._out[:1].copy_(torch.argmax(self.model.lm_head(last), dim=-1))


def wait_for_gpu(device: torch.device) -> None:
    """Block until the calling thread's stream on ``device`` has run its queued work, sleeping
    without the GIL; a no-op on the CPU.

    Why: reading a CUDA result on the host (``.item()``, ``.tolist()``) waits for the GPU while
    holding the GIL, so the worker's event loop, whose layer reads feed the next requests,
    cannot run for a whole step. On the H100 serving run at e798099, a decode worker busy with
    a batch delivered layers 10-200 ms after their publication, against 0.2-2.6 ms while idle
    (``bench/results/gpu-20261206-s39``, call 5). A blocking-sync event's ``synchronize``
    releases the GIL while it waits; the host read after it finds the result ready."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event(blocking=True)
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cache_bytes_for(model: Any, max_batch: int, max_len: int) -> int:
    """Device bytes a :class:`BatchDecoder` of these sizes allocates for its cache."""
    cfg = model.config
    itemsize = model.lm_head.weight.element_size()
    max_len = -(-max_len // MIN_BUCKET) * MIN_BUCKET
    return (2 * cfg.num_hidden_layers * max_batch * cfg.num_key_value_heads * max_len
            * cfg.head_dim * itemsize)


def bench_rows(model: Any, *, context: int, steps: int, batches: list[int],
               floor_ms: float) -> list[dict[str, Any]]:
    """TPOT of the batched step at each batch size, with and without CUDA graphs, after a
    ``context``-token prompt of random KV (``bench/model_speed.py``)."""
    import time
    rows: list[dict[str, Any]] = []
    cfg = model.config
    for graphs in (False, True):
        for b in batches:
            dec = BatchDecoder(model, max_batch=max(batches), max_len=context + steps + 8,
                               graphs=graphs)
            shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
            layers = [(torch.randn(shape, dtype=dec.dtype, device=dec.device),
                       torch.randn(shape, dtype=dec.dtype, device=dec.device))
                      for _ in range(cfg.num_hidden_layers)]
            for _ in range(b):
                dec.admit(layers)
            del layers
            toks = [1] * b
            for _ in range(3):
                toks = dec.step(toks)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                toks = dec.step(toks)
            tpot = (time.perf_counter() - t0) / steps * 1e3
            rows.append({"what": "decode-batched", "attn": "grouped", "batch": b,
                         "context": context, "graphs": graphs, "tpot_ms": tpot,
                         "x_floor": tpot / floor_ms, "captures": dec.captures,
                         "cache_gib": dec.cache_bytes / 2**30})
            print(f"decode-batched graphs={graphs} batch={b}: {tpot:.2f} ms/step "
                  f"({tpot / floor_ms:.2f}x floor)", flush=True)
            del dec
            torch.cuda.empty_cache()
    return rows


__all__ = ["BatchDecoder", "DecodeCapacityError", "bucket", "cache_bytes_for", "bench_rows",
           "wait_for_gpu",
           "MIN_BUCKET", "BATCH_BUCKETS", "EXTEND_BUCKETS"]

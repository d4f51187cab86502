"""The model the serving workers run: Llama configs, random-weight builds, prefill and decode.

Nothing is downloaded: configs are written here and weights are drawn from a seeded generator, so
a prefill worker and a decode worker in different processes (or on different hosts) that build the
same config with the same seed hold bit-identical weights, and KV produced by one is valid for the
other.

The serving split, in the engine's terms (``put_kv``/``get_kv``, KV shaped ``(num_layers, 2, tokens,
kv_heads, head_dim)``; K is stored after RoPE, see :mod:`tract_async.serving.kv_cache`):

* prefill worker: ``prefill(model, prompt_ids, past_kv=<prefix hit>, on_layer=<put layer i>)``
  computes only the tokens after the cached prefix and hands over each layer's new KV as soon as
  it exists; the logits of the last position give the first generated token.
* decode worker: ``decode(model, kv, prompt_len, first_token=...)`` continues greedily from the
  prompt's KV. The async, layer-streaming forms are in :mod:`tract_async.serving.streaming`.
* :func:`reference_generate` is the single-process ground truth both are tested against.

Numerics: the attention is eager (one well-defined sequence of matmul and softmax), so runs are
reproducible on a device. Prefill of a suffix after a cached prefix computes the same arithmetic
as prefill of the whole prompt, on fewer rows. It gives the same bits wherever the GEMM gives a
row the same bits whatever the row count: on the CPU build used here (MKL, AVX-512) that holds
for any operand of 12 or more rows and for 4 or 8, so a block-aligned prefix hit with a long
suffix is bit-exact; a part of 1-3, 5-7 or 9-11 rows takes MKL's small-matrix kernel and differs
by a few ulp (measured <= 2.4e-6 absolute in fp32). GPUs (cuBLAS choosing algorithms by shape)
behave alike. Greedy tokens are unaffected unless two logits tie within that margin.
"""
from __future__ import annotations

import copy
import inspect
from typing import Any
import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import torch

from tract_async.extras import require

require("transformers", purpose="the serving model layer (tract_async.serving.model)")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import Cache, DynamicCache  # noqa: E402

from tract_async.serving.errors import KVShapeError, NothingToCompute, TokenIdError  # noqa: E402
from tract_async.serving.kv_cache import NotifyFn, build_cache, cache_to_kv, check_kv

TokenIds = Sequence[int] | torch.Tensor

#: Byte tokenizer ids (:mod:`tract_async.serving.tokenizer`): 0..255 are bytes, then specials.
_BYTE_VOCAB = 259
_BOS, _EOS, _PAD = 256, 257, 258


# --- configs ------------------------------------------------------------------------------------
def tiny_llama_config(*, num_layers: int = 4, max_position_embeddings: int = 4096) -> LlamaConfig:
    """A 4-layer, 128-wide Llama with GQA (4 query heads, 2 KV heads) over the byte vocabulary.

    Small enough that a prefill of a few hundred tokens takes milliseconds on a 2-core CPU, yet it
    keeps every structural feature of Llama-3 that the KV path depends on: grouped KV heads,
    head_dim independent of hidden/heads, RoPE, fp32 on CPU.
    """
    return LlamaConfig(
        vocab_size=_BYTE_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=_BOS,
        eos_token_id=_EOS,
        pad_token_id=_PAD,
        tie_word_embeddings=False,
        attn_implementation="eager",
        dtype="float32",
    )


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword a model's forward takes its cache under: ``cache`` in transformers >= 5.18
    (where ``past_key_values`` is deprecated), ``past_key_values`` before (the lent GPU image
    has 5.17)."""
    fwd = type(model).forward
    name = _CACHE_KW.get(fwd)
    if name is None:
        params = inspect.signature(fwd).parameters
        name = "cache" if "cache" in params else "past_key_values"
        _CACHE_KW[fwd] = name
    return {name: cache}


_CACHE_KW: dict[Any, str] = {}


def llama3_8b_config() -> LlamaConfig:
    """The Llama-3-8B geometry (32 layers, 4096 hidden, 32 heads, 8 KV heads, head_dim 128), bf16.

    Only the shape is Meta's; weights come from :func:`build_model`. RoPE uses the llama3
    frequency scaling of the 3.1 release so positions up to 128 Ki behave as in the real model.
    """
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
        attn_implementation="eager",
        dtype="bfloat16",
    )


# --- KV geometry ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVGeometry:
    """What the engine's ``KVLayout`` needs about a model: ``KVLayout(**dataclasses.asdict(g))``."""

    num_layers: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def kv_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the engine KV tensor for ``tokens`` tokens, all layers."""
        return (self.num_layers, 2, tokens, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, all layers, K and V (2 MiB for Llama-3-8B with 16-token blocks)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_tokens * self.kv_heads * self.head_dim * itemsize


def kv_layout_for(config: LlamaConfig, block_tokens: int) -> KVGeometry:
    """The KV geometry of ``config`` cut into blocks of ``block_tokens`` tokens.

    Raises:
        ValueError: ``block_tokens`` is not positive.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    return KVGeometry(
        num_layers=config.num_hidden_layers,
        block_tokens=block_tokens,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=_config_dtype(config),
    )


def _config_dtype(config: LlamaConfig) -> torch.dtype:
    dtype = config.dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


# --- building -----------------------------------------------------------------------------------
def _param_seed(seed: int, name: str) -> int:
    """A per-parameter seed from (seed, name): independent of construction order and of the
    other parameters, so adding a layer or drawing in parallel never shifts another tensor."""
    digest = hashlib.blake2b(f"tract-serving/{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


#: The attention implementations :func:`build_model` takes.
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("eager", "sdpa")


def allow_cudnn_attention(allow: bool) -> None:
    """Whether PyTorch's SDPA may pick cuDNN's attention kernels, process-wide.

    On Hopper PyTorch may prefer cuDNN's attention, which builds a cuDNN graph for every new
    (query length, key length) pair before it runs. A serving worker sees a new prompt length
    on nearly every request, and a prefix hit adds a new pair per hit length: the H100 serving
    runs of 2026-12-06 (``bench/results/gpu-20261206-s41``) lost 40-70 ms in the computing
    thread between layers 0 and 1 on half their requests and 0.8-1.1 s on the first prefix hits
    (``bench/layer_gaps.py``). Off, SDPA keeps to the flash and memory-efficient kernels, which
    take any length without a build step. ``bench/prefill_shapes.py`` measures both.

    Why cuDNN is chosen at all: PyTorch's SDPA tries its backends in a priority order whose
    default puts cuDNN last, but (as read in PyTorch's ``sdp_utils.cpp``, not yet confirmed on
    our GPU image) a CUDA 13 build on sm90/sm100 with a runtime cuDNN newer than 9.15.0 moves
    cuDNN first; ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` is PyTorch's own switch for the same.
    """
    import torch
    torch.backends.cuda.enable_cudnn_sdp(allow)


def build_model(
    config: LlamaConfig,
    seed: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    init_device: str | torch.device = "cpu",
    attn: str = "eager",
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` in eval mode with deterministic random weights.

    The module is created on the meta device (no memory, no wasted init), materialized on
    ``device`` in ``dtype`` (default: the config's), and each parameter is drawn from its own
    generator seeded by ``(seed, parameter name)`` on ``init_device``, in fp32, then cast. With
    the default ``init_device="cpu"`` the weights are bit-identical in every process and on every
    host and device. ``init_device="cuda"`` draws on the GPU (fast for 8B, where the CPU needs
    about a minute) and is identical across GPU processes but not equal to the CPU draw.

    Initialization: embeddings N(0, 1); every linear weight N(0, 1/fan_in) so activations keep
    their scale through the layers and a random model emits varied tokens instead of a constant;
    RMSNorm weights 1.

    ``attn`` is transformers' attention implementation: ``"eager"`` (the default: one
    well-defined matmul-softmax-matmul, reproducible, what the CPU tests compare against) or
    ``"sdpa"`` (PyTorch's fused scaled-dot-product attention: flash or memory-efficient kernels on
    a GPU, no materialized attention matrix; what a GPU serving run wants, see issue 38).

    Raises:
        ValueError: the config is not a Llama config, or ``attn`` is neither eager nor sdpa.
    """
    if not isinstance(config, LlamaConfig):
        raise ValueError(f"build_model needs a LlamaConfig, got {type(config).__name__}")
    dtype = dtype or _config_dtype(config)
    device = torch.device(device)
    config = copy.deepcopy(config)  # the caller's config is left as it was
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn must be one of {ATTN_IMPLEMENTATIONS}, got {attn!r}")
    config._attn_implementation = attn
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=init_device).manual_seed(_param_seed(seed, name))
            std = 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5
            draw = torch.empty(param.shape, dtype=torch.float32, device=init_device)
            draw.normal_(0.0, std, generator=gen)
            param.copy_(draw.to(dtype))
        # Non-persistent buffers (RoPE inverse frequencies) were left uninitialized on the meta
        # device: rebuild the rotary module for real and move it over.
        rotary = type(model.model.rotary_emb)(config=config)
        model.model.rotary_emb = rotary.to(device)
    return model.eval()


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes: equal digests, equal weights."""
    hasher = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        hasher.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


# --- prefill ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillResult:
    """What a prefill produced.

    ``logits`` are those of the last prompt position (vocab,), from which the first token is drawn;
    ``kv`` is the whole prompt's KV ``(num_layers, 2, total_len, kv_heads, head_dim)``: the cached
    prefix (copied from ``past_kv``) followed by the ``total_len - past_len`` computed tokens.
    """

    logits: torch.Tensor
    kv: torch.Tensor
    past_len: int
    total_len: int

    @property
    def new_tokens(self) -> int:
        return self.total_len - self.past_len

    @property
    def next_token(self) -> int:
        """The greedy first generated token."""
        return int(torch.argmax(self.logits))


def as_ids(input_ids: TokenIds, vocab_size: int) -> list[int]:
    """Token ids as a list, checked against the vocabulary.

    Raises:
        TokenIdError: empty, not 1-D (a (1, n) tensor is accepted), or an id outside [0, vocab).
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise TokenIdError(f"expected 1-D token ids (or shape (1, n)), got {tuple(input_ids.shape)}")
        ids = [int(t) for t in input_ids.tolist()]
    else:
        ids = [int(t) for t in input_ids]
    if not ids:
        raise TokenIdError("token ids are empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise TokenIdError(f"token ids must be in [0, {vocab_size}), got {bad[:5]}")
    return ids


def _geometry(model: LlamaForCausalLM) -> tuple[int, int, int, torch.dtype, torch.device]:
    cfg = model.config
    param = model.lm_head.weight
    return cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, param.dtype, param.device


def prefill(
    model: LlamaForCausalLM,
    input_ids: TokenIds,
    *,
    past_kv: torch.Tensor | None = None,
    past_len: int | None = None,
    on_layer: NotifyFn | None = None,
) -> PrefillResult:
    """Run the prompt through the model, computing only the tokens after a cached prefix.

    ``input_ids`` is the *whole* prompt. ``past_kv`` is the KV of its first ``past_len`` tokens
    in the engine layout ``(num_layers, 2, >= past_len, kv_heads, head_dim)`` (only the first
    ``past_len`` tokens are used, so a whole-block ``get_kv`` result can be passed as is);
    ``past_len`` defaults to all of ``past_kv``. ``on_layer(i, kv_layer)`` is called once per
    layer, in layer order, with a new tensor ``(2, new_tokens, kv_heads, head_dim)`` holding layer
    ``i``'s K (after RoPE) and V of the new tokens; it runs in the computing thread as soon as the
    layer's K/V projections are done, before that layer's attention and before layer ``i + 1``.
    On a GPU the tensor may still be being computed on the current stream (order on the stream,
    or synchronize, before a copy on another one). An exception raised by ``on_layer`` aborts the
    prefill and propagates.

    Raises:
        TokenIdError: the prompt is empty or has ids outside the vocabulary.
        KVShapeError: ``past_kv`` does not match the model's geometry or holds < ``past_len``
            tokens, or a non-zero ``past_len`` came without ``past_kv``.
        NothingToCompute: ``past_len >= len(prompt)``; compute at least the last token.
    """
    num_layers, kv_heads, head_dim, dtype, device = _geometry(model)
    ids = as_ids(input_ids, model.config.vocab_size)
    if past_kv is None:
        if past_len not in (None, 0):
            raise KVShapeError(f"past_len={past_len} given without past_kv")
        past_len = 0
    else:
        if past_len is None:
            past_len = int(past_kv.shape[2]) if past_kv.dim() == 5 else 0
        check_kv(past_kv, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim,
                 dtype=dtype, min_tokens=past_len, what="past_kv")
        past_kv = past_kv[:, :, :past_len].to(device)
    if past_len >= len(ids):
        raise NothingToCompute(
            f"past_len={past_len} covers the whole {len(ids)}-token prompt; "
            f"pass past_len={len(ids) - 1} to recompute only the last token"
        )
    cache = build_cache(num_layers, past_kv=past_kv, notify=on_layer)
    new_ids = torch.tensor([ids[past_len:]], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=new_ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        kv = cache_to_kv(cache)
    return PrefillResult(logits=out.logits[0, -1], kv=kv, past_len=past_len, total_len=len(ids))


# --- decode -------------------------------------------------------------------------------------
def greedy_continue(
    model: LlamaForCausalLM,
    cache: Cache,
    first_token: int,
    *,
    max_new_tokens: int,
    eos_token_id: int | None,
    should_stop: Callable[[], None] | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Greedy tokens after ``first_token`` given a cache holding everything before it.

    Returns ``[first_token, ...]``, at most ``max_new_tokens`` long, ending at the first EOS.
    ``should_stop()`` (optional) is checked before each step and may raise to abort.
    ``on_token(token)`` (optional) is called with each token computed here (not ``first_token``)
    as soon as it exists.
    """
    tokens: list[int] = []
    token = first_token
    device = model.lm_head.weight.device
    with torch.no_grad():
        while True:
            tokens.append(token)
            if len(tokens) >= max_new_tokens or token == eos_token_id:
                return tokens
            if should_stop is not None:
                should_stop()
            step = torch.tensor([[token]], dtype=torch.long, device=device)
            out = model(input_ids=step, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
            token = int(torch.argmax(out.logits[0, -1]))
            if on_token is not None:
                on_token(token)


def decode(
    model: LlamaForCausalLM,
    kv: torch.Tensor,
    prompt_len_or_ids: int | TokenIds,
    *,
    max_new_tokens: int,
    first_token: int | None = None,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy generation continuing from the prompt's KV (as a decode worker gets it).

    ``kv`` is ``(num_layers, 2, >= prompt_len, kv_heads, head_dim)``; only the first ``prompt_len``
    tokens are used. Give ``first_token`` (the prefill worker's ``PrefillResult.next_token``) with
    the prompt length or ids. Without it, pass the prompt ids: the last prompt position is then
    recomputed from ``kv[:, :, :prompt_len - 1]`` to get its logits, which costs one token of
    compute and replaces that token's KV. Returns the generated tokens starting with the first,
    at most ``max_new_tokens`` of them, stopping after ``eos_token_id``: the same list as
    :func:`reference_generate` for the same prompt.

    Raises:
        KVShapeError: ``kv`` does not match the model or holds fewer than ``prompt_len`` tokens.
        TokenIdError: bad prompt ids, or ``first_token`` outside the vocabulary.
        ValueError: ``first_token`` is None and only a prompt length was given, or
            ``max_new_tokens`` is negative.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    num_layers, kv_heads, head_dim, dtype, device = _geometry(model)
    if isinstance(prompt_len_or_ids, int):
        prompt_len, ids = prompt_len_or_ids, None
    else:
        ids = as_ids(prompt_len_or_ids, model.config.vocab_size)
        prompt_len = len(ids)
    if prompt_len <= 0:
        raise TokenIdError(f"prompt length must be positive, got {prompt_len}")
    check_kv(kv, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
             min_tokens=prompt_len, what="decode kv")
    if max_new_tokens == 0:
        return []
    if first_token is None:
        if ids is None:
            raise ValueError("decode without first_token needs the prompt ids, not just its length")
        head = prefill(model, ids, past_kv=kv, past_len=prompt_len - 1)
        first_token, past = head.next_token, head.kv
    else:
        as_ids([first_token], model.config.vocab_size)
        past = kv[:, :, :prompt_len].to(device)
    cache = build_cache(num_layers, past_kv=past)
    return greedy_continue(model, cache, first_token, max_new_tokens=max_new_tokens,
                           eos_token_id=eos_token_id)


def reference_generate(
    model: LlamaForCausalLM,
    input_ids: TokenIds,
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> list[int]:
    """Plain single-process greedy generation: the ground truth for the disaggregated path.

    Uses transformers' own ``DynamicCache`` and none of this package's cache adapters, so a bug
    in the adapters cannot hide in both sides of a comparison. Returns the new tokens only.

    Raises:
        TokenIdError: bad prompt ids.
        ValueError: ``max_new_tokens`` is negative.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = as_ids(input_ids, model.config.vocab_size)
    if max_new_tokens == 0:
        return []
    device = model.lm_head.weight.device
    cache = DynamicCache(config=model.config)
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    first = int(torch.argmax(out.logits[0, -1]))
    return greedy_continue(model, cache, first, max_new_tokens=max_new_tokens,
                           eos_token_id=eos_token_id)

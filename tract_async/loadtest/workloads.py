"""Seeded request streams of known prefix reuse, for the load benchmark (``tract bench serve``).

The paper's claim is about prefix reuse: the gain of a rack-wide prefix cache grows with the
share of a prompt that an earlier prompt already had. So each workload here is built to have a
known reuse, and :func:`ideal_hit_blocks` computes it exactly (what an infinite cache would hit
with the requests served one after the other), to put next to the hit rate measured:

* ``chat``: multi-turn conversations sharing one system prompt; turn ``k``'s prompt is turn
  ``k - 1``'s prompt plus the assistant's reply and the next user message (a growing history);
* ``rag``: documents, each asked several different questions (instruction + document shared,
  the question unique);
* ``agentic``: every call carries the same tool definitions (a third of the way through the
  length range), then a task of its own;
* ``unique``: no reuse at all (only the BOS token is shared; no full block is).

Prompts are token ids drawn from a seeded generator, never text: the byte tokenizer of the tiny
model would otherwise make lengths depend on UTF-8, and a random-weight model's replies are not
text either. The assistant replies inside a chat history are drawn too, not the model's output,
so that every prompt is fixed before the run: every system gets identical prompts, and an open
loop can send turn ``k + 1`` on its arrival time without waiting for turn ``k``'s reply.

Reproducibility: the same :class:`WorkloadSpec` gives the same token ids in every process (numpy
``SeedSequence`` over ``(seed, phase, kind, part...)``: no Python ``hash``, no global state).
``phase`` salts a whole stream, so two phases of one run (two request rates, say) share no block
and the second cannot hit what the first stored.

Order: requests interleave their groups (conversation 0 turn 0, conversation 1 turn 0, ...,
conversation 0 turn 1, ...), as many users would, so that under load a turn usually arrives after
its predecessor was served; when it does not (an overloaded system), it hits less than the ideal.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

WORKLOADS: tuple[str, ...] = ("chat", "rag", "agentic", "unique")
_KIND_CODE = {name: i + 1 for i, name in enumerate(WORKLOADS)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Vocab:
    """Which ids a prompt may use: ``bos_id`` first, then ids in ``[0, token_high)``."""
    bos_id: int
    token_high: int

    @classmethod
    def for_model(cls, model: str) -> Vocab:
        """The tiny byte-level model (ids 0-255 are bytes, 256 BOS) or Llama-3 (BOS 128000)."""
        if model == "tiny":
            return cls(bos_id=256, token_high=256)
        if model == "llama3-8b":
            return cls(bos_id=128000, token_high=128000)
        raise ValueError(f"no vocabulary known for model {model!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    """One stream of ``requests`` requests of one ``kind``.

    ``min_input_tokens``/``max_input_tokens`` bound every prompt (the paper's range is 512-8K;
    a tiny CPU model runs them scaled down). ``group_size`` is the turns per conversation
    (chat), questions per document (rag) or calls per tool set (agentic: one tool set for
    ``group_size`` calls); unused by ``unique``.
    """
    kind: str
    requests: int
    seed: int = 0
    phase: int = 0
    min_input_tokens: int = 512
    max_input_tokens: int = 8192
    output_tokens: int = 64
    group_size: int = 4
    vocab: Vocab = dataclasses.field(default_factory=lambda: Vocab.for_model("tiny"))

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.kind!r}")
        if self.requests < 0 or self.seed < 0 or self.phase < 0:
            raise ValueError("requests, seed and phase must be >= 0")
        if not 8 <= self.min_input_tokens <= self.max_input_tokens:
            raise ValueError(f"need 8 <= min_input_tokens <= max_input_tokens, got "
                             f"{self.min_input_tokens}, {self.max_input_tokens}")
        if self.output_tokens < 1 or self.group_size < 1:
            raise ValueError("output_tokens and group_size must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """One request of a stream: its prompt ids and how many tokens to generate."""
    index: int
    workload: str
    group: int          # conversation / document / tool set; the request's own index for unique
    step: int           # turn / question / call within the group
    prompt_ids: tuple[int, ...]
    max_tokens: int


class _Draw:
    """Token ids from ``SeedSequence((seed, phase, kind, *part))``: one stream per part."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self.base = (spec.seed, spec.phase, _KIND_CODE[spec.kind])

    def rng(self, *part: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([*self.base, *part]))

    def tokens(self, n: int, *part: int) -> list[int]:
        return self.rng(*part).integers(0, self.spec.vocab.token_high, size=max(0, n)).tolist()


def build_requests(spec: WorkloadSpec) -> list[LoadRequest]:
    """The stream of ``spec``: deterministic, in arrival order (see the module docstring)."""
    builder = {"chat": _chat, "rag": _rag, "agentic": _agentic, "unique": _unique}[spec.kind]
    prompts = builder(spec, _Draw(spec))
    out = []
    for index, (group, step, ids) in enumerate(prompts[:spec.requests]):
        assert spec.min_input_tokens <= len(ids) <= spec.max_input_tokens, \
            f"workloads: {spec.kind} built a {len(ids)}-token prompt outside the bounds"
        out.append(LoadRequest(index=index, workload=spec.kind, group=group, step=step,
                               prompt_ids=tuple(ids), max_tokens=spec.output_tokens))
    return out


def _groups(spec: WorkloadSpec) -> int:
    return max(1, math.ceil(spec.requests / spec.group_size))


_Prompt = tuple[int, int, list[int]]   # (group, step, token ids)


def _interleave(per_group: list[list[_Prompt]]) -> list[_Prompt]:
    """Step 0 of every group, then step 1 of every group, ..."""
    out = []
    for step in range(max((len(g) for g in per_group), default=0)):
        out += [g[step] for g in per_group if step < len(g)]
    return out


def _chat(spec: WorkloadSpec, draw: _Draw) -> list[_Prompt]:
    # Turn k's prompt is system + k * (user + reply) + user: the first turn has min_input_tokens,
    # the last at most max_input_tokens, growing by one step per turn.
    turns, lo, hi = spec.group_size, spec.min_input_tokens, spec.max_input_tokens
    step = (hi - lo) // (turns - 1) if turns > 1 else 0
    if turns > 1 and step < 2:
        raise ValueError(f"chat: {turns} turns need max_input_tokens - min_input_tokens >= "
                         f"{2 * (turns - 1)} (the history grows every turn), got {lo}..{hi}")
    user = max(1, min(lo // 4, step // 3 if step else lo // 4))
    reply = step - user
    system = [spec.vocab.bos_id] + draw.tokens(lo - user - 1, 0)
    per_group = []
    for c in range(_groups(spec)):
        history = list(system)
        convo = []
        for k in range(turns):
            history += draw.tokens(user, 1, c, k)              # the user's message
            convo.append((c, k, list(history)))
            if reply > 0:
                history += draw.tokens(reply, 2, c, k)         # the assistant's (drawn) reply
        per_group.append(convo)
    return _interleave(per_group)


def _rag(spec: WorkloadSpec, draw: _Draw) -> list[_Prompt]:
    # One instruction for all; each document's length drawn so that prompts span the range.
    lo, hi = spec.min_input_tokens, spec.max_input_tokens
    question = max(1, lo // 8)
    instruction = [spec.vocab.bos_id] + draw.tokens(max(1, lo // 16) - 1, 0)
    fixed = len(instruction) + question
    per_group = []
    for d in range(_groups(spec)):
        doc_len = int(draw.rng(3, d).integers(lo - fixed, hi - fixed + 1))
        context = instruction + draw.tokens(doc_len, 1, d)
        per_group.append([(d, q, context + draw.tokens(question, 2, d, q))
                          for q in range(spec.group_size)])
    return _interleave(per_group)


def _agentic(spec: WorkloadSpec, draw: _Draw) -> list[_Prompt]:
    # One tool set for every call, a third of the way through the length range (agents carry
    # thousands of tokens of tool schemas); each call's task fills the rest of its length.
    lo, hi = spec.min_input_tokens, spec.max_input_tokens
    tools_len = max(1, (lo + hi) // 3)
    tools = [spec.vocab.bos_id] + draw.tokens(tools_len - 1, 0)
    low_task = max(lo - tools_len, max(1, lo // 8))
    out = []
    for i in range(spec.requests):
        task_len = int(draw.rng(3, i).integers(low_task, max(low_task, hi - tools_len) + 1))
        out.append((i // spec.group_size, i % spec.group_size, tools + draw.tokens(task_len, 1, i)))
    return out


def _unique(spec: WorkloadSpec, draw: _Draw) -> list[_Prompt]:
    lo, hi = spec.min_input_tokens, spec.max_input_tokens
    out = []
    for i in range(spec.requests):
        n = int(draw.rng(3, i).integers(lo, hi + 1))
        out.append((i, 0, [spec.vocab.bos_id] + draw.tokens(n - 1, 1, i)))
    return out


# --- known reuse ----------------------------------------------------------------------------------
def ideal_hit_blocks(prompts: Iterable[Sequence[int]], block_tokens: int) -> list[int]:
    """Per prompt, its leading full blocks that an earlier prompt of the list also had (as a
    prefix of full blocks): what an unbounded prefix cache hits when the prompts are served one
    after the other and each stores its full blocks, as the prefill worker does."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    # A block is identified by (its parent's id, its tokens), as chained block hashes are, but
    # interned exactly: no hash collision can make two different prefixes equal.
    ids_of: dict[tuple[int, tuple[int, ...]], int] = {}
    out = []
    for ids in prompts:
        parent, hit, missed = -1, 0, False
        for b in range(len(ids) // block_tokens):
            key = (parent, tuple(ids[b * block_tokens:(b + 1) * block_tokens]))
            known = ids_of.get(key)
            if known is None:
                missed = True
                known = ids_of[key] = len(ids_of)
            elif not missed:
                hit += 1
            parent = known
        out.append(hit)
    return out


def ideal_hit_rate(requests: Sequence[LoadRequest], block_tokens: int) -> float:
    """Block-weighted ideal hit rate of a stream (0 when it has no full block)."""
    hits = ideal_hit_blocks((r.prompt_ids for r in requests), block_tokens)
    full = sum(len(r.prompt_ids) // block_tokens for r in requests)
    return sum(hits) / full if full else 0.0


__all__ = ["LoadRequest", "Vocab", "WORKLOADS", "WorkloadSpec", "build_requests",
           "ideal_hit_blocks", "ideal_hit_rate"]

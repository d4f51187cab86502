"""A built-in byte-level tokenizer and chat template, so the demo needs nothing from a model hub.

Ids 0..255 are the bytes of the UTF-8 text; 256, 257 and 258 are BOS, EOS and PAD. There are no
merges, which gives the property the prefix cache is built on: the encoding of a text is a prefix
of the encoding of any text it is a prefix of (``encode(a + b) == encode(a) + encode(b)``, after a
single leading BOS). With :func:`render_chat`, where each turn of a conversation appends to the
rendering of the turns before it, every request of a multi-turn chat extends the previous one's
prompt, and all chats with the same system prompt share that prefix.

The template's role markers are plain text, not special ids: a message whose content contains a
marker renders ambiguously. That is acceptable for a synthetic workload; a real deployment uses
the model's own tokenizer.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from tract_async.serving.errors import ChatTemplateError, TokenizerError

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ByteTokenizer:
    """Bytes as ids plus three specials; stateless, so one instance can serve every worker."""

    bos_token_id: int = 256
    eos_token_id: int = 257
    pad_token_id: int = 258

    @property
    def vocab_size(self) -> int:
        """259: the tiny model's vocabulary (``tiny_llama_config().vocab_size``)."""
        return 259

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset((self.bos_token_id, self.eos_token_id, self.pad_token_id))

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, optionally framed by BOS and EOS.

        Raises:
            TokenizerError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode needs a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_token_id)
        if add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Invalid UTF-8 (a random model emits arbitrary bytes) becomes U+FFFD.

        With ``skip_special_tokens=False`` the specials render as ``<bos>``, ``<eos>``, ``<pad>``.

        Raises:
            TokenizerError: an id is neither a byte nor one of the three specials.
        """
        names = {self.bos_token_id: "<bos>", self.eos_token_id: "<eos>", self.pad_token_id: "<pad>"}
        out: list[str] = []
        run = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < 256:
                run.append(token)
                continue
            if token not in names:
                raise TokenizerError(f"id {token} is not a byte (0..255) or a special token {sorted(names)}")
            if not skip_special_tokens:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
                out.append(names[token])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """Ids of :func:`render_chat` with a leading BOS: the prompt of one chat request.

        Raises:
            ChatTemplateError: see :func:`render_chat`.
        """
        return self.encode(render_chat(messages, add_generation_prompt=add_generation_prompt))


def render_chat(messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
    """Render ``[{"role": ..., "content": ...}, ...]`` as one prompt text.

    Each message becomes ``<|role|>\\n{content}<|end|>\\n``; with ``add_generation_prompt`` the
    text ends with ``<|assistant|>\\n`` where the model's reply goes. The rendering of a
    conversation is therefore a prefix of the rendering of the same conversation after the
    assistant's reply and the next user turn are appended, which is what makes a multi-turn chat
    hit the prefix cache.

    Raises:
        ChatTemplateError: a message lacks ``role`` or ``content``, the role is not one of
            system/user/assistant, or the content is not a str.
    """
    parts: list[str] = []
    for index, message in enumerate(messages):
        try:
            role, content = message["role"], message["content"]
        except (KeyError, TypeError) as exc:
            raise ChatTemplateError(f"message {index}: expected a mapping with 'role' and 'content'") from exc
        if role not in ROLES:
            raise ChatTemplateError(f"message {index}: role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"message {index}: content must be a str, got {type(content).__name__}")
        parts.append(f"<|{role}|>\n{content}<|end|>\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)

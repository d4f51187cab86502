"""Errors of the serving model layer: one class per condition, all deriving from ``TractError``.

They follow the library's tiers: misuse (a KV tensor of the wrong geometry, token ids outside the
vocabulary, nothing left to compute) raises an error whose message says what was expected and what
was found, before any state changes; a wait that runs past its deadline raises a typed timeout the
worker can handle.
"""
from __future__ import annotations

from tract_async.errors import TractError


class ServingError(TractError):
    """Base of every error raised by :mod:`tract_async.serving`."""


class KVShapeError(ServingError, ValueError):
    """A KV tensor does not match the model's geometry (shape, dtype, or token count)."""


class TokenIdError(ServingError, ValueError):
    """Token ids are empty, not one-dimensional, or outside the model's vocabulary."""


class NothingToCompute(ServingError, ValueError):
    """A prefill was asked for no new tokens (the cached prefix covers the whole prompt).

    The logits of the last prompt position are needed for the first generated token, so at least
    one token must be computed: pass ``past_len=len(prompt) - 1`` when the whole prompt is cached.
    """


class LayerWaitTimeout(ServingError, TimeoutError):
    """Streaming decode waited longer than its deadline for one layer's KV."""


class TokenizerError(ServingError, ValueError):
    """Ids that are not bytes or known special tokens were given to the byte tokenizer."""


class ChatTemplateError(ServingError, ValueError):
    """A chat message has an unknown role or non-string content."""


class BadCompletionRequest(ServingError, ValueError):
    """A ``/v1/completions`` (or worker) request body is malformed: answered with HTTP 400."""


class UpstreamFailed(ServingError):
    """A worker the router called answered with an error, or the connection to it broke."""


class KVPoolFull(ServingError):
    """HTTP mode: the prefill worker's registered KV pool had no room within the deadline."""


class KVUnavailable(ServingError):
    """The decode worker could not obtain the prompt's KV (evicted, never produced, timed out)."""


class ServiceStartFailed(ServingError):
    """A launched service exited, or did not report ready before its deadline."""


class ServiceConfigError(ServingError, ValueError):
    """A service was configured with an unknown mode, model, device or an inconsistent option."""

"""Exceptions of the network transports (the HTTP agent, and the NIXL agent of ``nixl_agent``):
one class per condition, all deriving from TractError.

A transport has one error channel: a failed call or transfer raises one of these (the NIXL agent
maps NIXL's status codes onto the same classes). Status
strings ("DONE", "PROC") only ever describe progress, never failure. The server maps each
condition to an error code on the wire (``ERROR_CODES``) and the client raises the same class,
so a caller sees the same exception whether its own agent or the remote one found the problem.
"""
from __future__ import annotations

from tract_async.errors import TractError


class TransportError(TractError):
    """Base of every error of the NIXL-style HTTP transport."""


# --- misuse (message says what to change) ---------------------------------------------------
class TransportConfigError(TransportError, ValueError):
    """The Agent was configured in a way that is unsafe or inconsistent (e.g. no secret off loopback)."""


class InvalidDescriptors(TransportError, ValueError):
    """A descriptor list is malformed or does not match its partner (count, lengths, memory type)."""


class MemoryNotRegistered(TransportError, ValueError):
    """A local descriptor, or the buffer passed to deregister, is not inside registered memory."""


class MemoryAlreadyRegistered(TransportError, ValueError):
    """The range overlaps memory already registered, or its name is taken."""


class UnknownRemoteAgent(TransportError, KeyError):
    """No remote agent of that name was added with add_remote_agent."""


class HandleReleased(TransportError):
    """The transfer handle was released (or its agent closed) and cannot be posted or polled."""


class InvalidOperation(TransportError, ValueError):
    """initialize_xfer got an operation other than "READ" or "WRITE"."""


class TransferCancelled(TransportError):
    """The transfer was cancelled (released, agent closed, or its waiter cancelled); no more bytes can land."""


class TransferInProgress(TransportError):
    """The handle is already posted and not finished; wait for it before posting it again."""


class AgentClosed(TransportError):
    """The Agent is closed (or not started) and cannot serve or start transfers."""


# --- bad input from a peer ---------------------------------------------------------------------
class MetadataError(TransportError, ValueError):
    """Agent metadata is malformed: not ours, not orjson, or missing or mistyped fields."""


class MetadataVersionMismatch(MetadataError):
    """Agent metadata was written by an incompatible format version."""


class AuthenticationFailed(TransportError):
    """The request was not signed, or signed with another secret, or the signature is wrong."""


class ReplayedRequest(AuthenticationFailed):
    """The request's nonce was already used, or its timestamp lies outside the replay window."""


class WrongRecipient(AuthenticationFailed):
    """The request was signed for another agent, or for an earlier incarnation of this one (the
    sender's metadata of it is stale: fetch it again)."""


class DescriptorOutOfRange(TransportError, ValueError):
    """A remote descriptor is not entirely inside memory registered (and, for WRITE, writable) there."""


class MalformedRequest(TransportError, ValueError):
    """The request framing or descriptor document could not be parsed."""


class TruncatedBody(TransportError):
    """A body ended before the length its framing or Content-Length announced."""


class RequestTooLarge(TransportError):
    """The request exceeds a size limit (descriptor count, document size or total bytes)."""


# --- the peer or the network -----------------------------------------------------------------------
class PeerUnreachable(TransportError, ConnectionError):
    """The remote agent's server could not be connected to."""


class PeerDisconnected(TransportError, ConnectionError):
    """The connection to the remote agent broke while a transfer was in flight."""


class TransferTimeout(TransportError, TimeoutError):
    """The transfer did not finish before its deadline; it was cancelled and no more bytes can land."""


class NotificationTimeout(TransportError, TimeoutError):
    """No matching notification arrived before the deadline."""


class PeerBusy(TransportError):
    """The remote agent already serves ``max_inflight_per_peer`` requests from this agent (HTTP
    429): nothing was done; retry after some of this agent's requests to it have finished."""


class RemoteError(TransportError):
    """The remote agent failed the request for a reason without a more specific class."""


class NixlError(TransportError):
    """A NIXL call failed for a reason without a more specific class; the message carries NIXL's
    status and what was being done (the NIXL transport, ``transport.nixl_agent``)."""


#: Wire error code <-> exception class. The server sends the code; the client raises the class.
ERROR_CODES: dict[str, type[TransportError]] = {
    "auth_failed": AuthenticationFailed,
    "replayed": ReplayedRequest,
    "wrong_recipient": WrongRecipient,
    "desc_out_of_range": DescriptorOutOfRange,
    "malformed": MalformedRequest,
    "truncated": TruncatedBody,
    "too_large": RequestTooLarge,
    "version": MetadataVersionMismatch,
    "closed": AgentClosed,
    "busy": PeerBusy,
    "remote": RemoteError,
}
CODE_OF: dict[type[TransportError], str] = {cls: code for code, cls in ERROR_CODES.items()}

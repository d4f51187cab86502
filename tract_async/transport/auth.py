"""Request authentication of the HTTP transport: HMAC-SHA256 over a canonical request, replay window.

Every signed request carries six headers: the sender's agent name, the recipient's agent name
and instance, a wall-clock timestamp, a random nonce and a signature. The signature is
HMAC-SHA256 with the shared secret over

    "tract-http-v2" \\n METHOD \\n PATH \\n sender \\n recipient \\n instance \\n timestamp \\n nonce \\n sha256(document)

where *recipient* and *instance* name the agent the request is addressed to: its name and the
random id of its incarnation (``new_instance``, drawn when the Agent is built and published in
its metadata). The *document* is the small part of the request that says what to do: the
descriptor list of a READ or WRITE (plus its notification), or the whole body of a notification
or of an application route. A signer's fields hold no line break (agent names must be printable,
the rest are route paths, numbers and hex), so no other request has the same string.

Why the recipient is bound: a rack shares one secret and every agent remembers only the nonces
it has seen itself, so without it a request captured on its way to agent A is accepted by agent
B (a READ stopped only by B's descriptor check, a notification delivered), and by A itself after
a restart (an empty nonce cache). The verifier fills in its *own* name and instance, never the
request's headers, so a request signed for anyone else fails; the recipient headers only let it
say so clearly (``WrongRecipient``) before it reads the body.

What is bound, route by route:

* READ, WRITE, notification (``/tract/v1/read``, ``/write``, ``/notif``) and every application
  route (``Agent.add_json_route``; the engine's hello, announce and check): recipient name and
  instance, from the recipient's metadata that the sender added (``add_remote_agent``; the
  engine's hello carries the sender's metadata, so its answerer learns it there).
* metadata fetch by URL (``GET /tract/v1/metadata``, ``fetch_remote_metadata``): also name and
  instance. The sender does not know them yet, so it first asks the unsigned identity route.
* identity (``GET /tract/v1/identity``): not signed, and answers only the protocol string, the
  name and the instance, which every request addressed to that agent carries in clear anyway.
  It changes nothing and reveals no memory.

The sender's own instance is not bound: the recipient attributes a request to a sender by name
only (notifications, application routes), so binding it would add nothing it checks.

Payload bytes of a WRITE are not covered: hashing them would cost a pass over every byte (the
transport's whole budget on this hardware), and the threat this guards against is an
unauthorised peer naming memory, not a man in the middle; deploy TLS (or a private network)
where bytes on the wire must be protected.

The replay window: a timestamp more than ``window_s`` away from the server's clock is refused,
and a nonce seen within the window is refused. Nonces are remembered only after the signature
checks out, so unauthenticated traffic cannot fill the cache; the cache is bounded
(``max_nonces``) and a full cache refuses requests rather than forgetting early (fail closed).
Without a secret (loopback test setups only) nothing is checked.

Protocol versions: the domain string changes whenever the canonical string does.
``tract-http-v1`` bound no recipient and sent no recipient headers; a v2 agent refuses a v1
request with a message naming both versions, a v1 agent refuses a v2 request as a signature
mismatch, and before either, metadata format 2 (which v1 cannot read) keeps them from pairing.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Mapping

from tract_async.transport.errors import (
    AuthenticationFailed,
    ReplayedRequest,
    TransportConfigError,
    WrongRecipient,
)

H_AGENT = "X-Tract-Agent"
H_TO = "X-Tract-To"
H_TO_INSTANCE = "X-Tract-To-Instance"
H_TIME = "X-Tract-Time"
H_NONCE = "X-Tract-Nonce"
H_SIG = "X-Tract-Signature"

PROTOCOL = "tract-http-v2"   # the domain string; change it whenever the canonical string changes
_DOMAIN = PROTOCOL.encode()
_NONCE_BYTES = 16
_INSTANCE_BYTES = 16


def coerce_secret(secret: bytes | str | None) -> bytes | None:
    if secret is None:
        return None
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(key) < 16:
        raise TransportConfigError("the shared secret must be at least 16 bytes (use secrets.token_bytes(32))")
    return key


def key_id(secret: bytes | None) -> str:
    """A short fingerprint of the secret that the metadata publishes, so a mismatch is found at
    add_remote_agent time with a clear message. It reveals nothing usable about the secret."""
    if secret is None:
        return "none"
    return hmac.new(secret, b"tract-key-id", hashlib.sha256).hexdigest()[:16]


def new_instance() -> str:
    """A fresh random instance id (32 hex digits): one per Agent, so a restarted agent of the same
    name is another recipient."""
    return os.urandom(_INSTANCE_BYTES).hex()


def is_instance(value: object) -> bool:
    """Is ``value`` shaped like a ``new_instance`` id?"""
    return (isinstance(value, str) and len(value) == 2 * _INSTANCE_BYTES
            and all(c in "0123456789abcdef" for c in value))


def _canonical(method: str, path: str, sender: str, recipient: str, instance: str, ts: str, nonce: str,
               doc: bytes) -> bytes:
    return b"\n".join((_DOMAIN, method.upper().encode(), path.encode(), sender.encode(), recipient.encode(),
                       instance.encode(), ts.encode(), nonce.encode(), hashlib.sha256(doc).hexdigest().encode()))


def _shown(value: str) -> str:
    """A header value quoted for an error message, cut short (it comes from the peer)."""
    return repr(value[:80] + ("..." if len(value) > 80 else ""))


class Signer:
    """Produces the auth headers of one agent's outgoing requests."""

    def __init__(self, name: str, secret: bytes | None) -> None:
        self.name = name
        self._secret = secret

    def headers(self, method: str, path: str, doc: bytes, *, to: str, to_instance: str) -> dict[str, str]:
        """Headers for one request addressed to agent ``to``, incarnation ``to_instance`` (both
        from its metadata or identity); a fresh nonce and timestamp each call (never reuse them)."""
        ts = f"{time.time():.6f}"
        nonce = os.urandom(_NONCE_BYTES).hex()
        h = {H_AGENT: self.name, H_TO: to, H_TO_INSTANCE: to_instance, H_TIME: ts, H_NONCE: nonce}
        if self._secret is not None:
            h[H_SIG] = hmac.new(self._secret, _canonical(method, path, self.name, to, to_instance, ts, nonce, doc),
                                hashlib.sha256).hexdigest()
        return h


class Verifier:
    """Checks the requests addressed to one agent (``name``, incarnation ``instance``); owns the
    replay cache."""

    def __init__(self, secret: bytes | None, *, name: str, instance: str, window_s: float = 30.0,
                 max_nonces: int = 1 << 20) -> None:
        self._secret = secret
        self.name = name
        self.instance = instance
        self.window_s = window_s
        self.max_nonces = max_nonces
        # nonce -> monotonic expiry; insertion order is expiry order, so pruning pops from the front.
        self._seen: dict[str, float] = {}

    def sender(self, headers: Mapping[str, str]) -> str:
        """The claimed sender name (authenticated only once ``verify`` passed)."""
        return headers.get(H_AGENT, "")

    def precheck(self, headers: Mapping[str, str]) -> None:
        """Cheap checks before any body byte is read: headers present, addressed to this agent
        (as the headers claim; the signature proves it), timestamp in the window.

        Raises AuthenticationFailed (missing or malformed headers, a sender of an older protocol),
        WrongRecipient (addressed to another agent or incarnation), ReplayedRequest (stale time).
        """
        if self._secret is None:
            return
        for h in (H_AGENT, H_TIME, H_NONCE, H_SIG):
            if not headers.get(h):
                raise AuthenticationFailed(f"missing {h} header: this agent requires signed requests")
        if not headers.get(H_TO) or not headers.get(H_TO_INSTANCE):
            raise AuthenticationFailed(
                f"request does not name its recipient (no {H_TO} / {H_TO_INSTANCE} header): the sender "
                f"speaks tract-http-v1 or older, this agent verifies {PROTOCOL}; upgrade the sender")
        to, to_instance = headers[H_TO], headers[H_TO_INSTANCE]
        if to != self.name:
            raise WrongRecipient(
                f"request is addressed to agent {_shown(to)}, this is agent {self.name!r}: a request "
                "signed for one agent is refused by every other (sent to the wrong address, or replayed)")
        if to_instance != self.instance:
            raise WrongRecipient(
                f"request is addressed to another incarnation of agent {self.name!r}: it restarted since "
                "the sender read its metadata (fetch the metadata again), or the request is replayed")
        try:
            ts = float(headers[H_TIME])
        except ValueError:
            raise AuthenticationFailed(f"malformed {H_TIME} header") from None
        if not abs(time.time() - ts) <= self.window_s:  # also refuses NaN
            raise ReplayedRequest(f"request timestamp is outside the {self.window_s:g} s replay window")

    def verify(self, method: str, path: str, headers: Mapping[str, str], doc: bytes) -> None:
        """Full check: the precheck, the signature over the canonical request addressed to this
        agent, then nonce freshness.

        Raises AuthenticationFailed (bad signature), WrongRecipient, ReplayedRequest (stale time,
        nonce seen, or cache full).
        """
        if self._secret is None:
            return
        self.precheck(headers)
        # Our own name and instance, not the headers': a request signed for anyone else fails here.
        want = hmac.new(self._secret, _canonical(method, path, headers[H_AGENT], self.name, self.instance,
                                                 headers[H_TIME], headers[H_NONCE], doc), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, headers[H_SIG]):
            raise AuthenticationFailed(f"request signature does not match ({PROTOCOL}): wrong shared secret, "
                                       "altered request, or a sender of another protocol version")
        now = time.monotonic()
        self._prune(now)
        nonce = headers[H_NONCE]
        if nonce in self._seen:
            raise ReplayedRequest("request nonce was already used (replayed request)")
        if len(self._seen) >= self.max_nonces:
            raise ReplayedRequest("replay cache is full; retry later")
        # Remember it for two windows: a timestamp may be up to one window ahead of our clock.
        self._seen[nonce] = now + 2 * self.window_s

    def _prune(self, now: float) -> None:
        seen = self._seen
        while seen:
            first = next(iter(seen))
            if seen[first] > now:
                break
            del seen[first]


__all__ = ["Signer", "Verifier", "key_id", "new_instance", "is_instance", "PROTOCOL", "H_AGENT", "H_TO",
           "H_TO_INSTANCE", "H_TIME", "H_NONCE", "H_SIG", "coerce_secret"]

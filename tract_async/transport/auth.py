"""Request authentication of the HTTP transport: HMAC-SHA256 over a canonical request, replay window.

Every request carries four headers: the sender's agent name, a wall-clock timestamp, a random
nonce and a signature. The signature is HMAC-SHA256 with the shared secret over

    "tract-http-v1" \\n METHOD \\n PATH \\n sender \\n timestamp \\n nonce \\n sha256(document)

where the *document* is the small part of the request that says what to do: the descriptor list
of a READ or WRITE (plus its notification), or the whole body of a notification or of an
application route. Payload bytes of a WRITE are not covered: hashing them would cost a pass over
every byte (the transport's whole budget on this hardware), and the threat this guards against is
an unauthorised peer naming memory, not a man in the middle; deploy TLS (or a private network)
where bytes on the wire must be protected.

The replay window: a timestamp more than ``window_s`` away from the server's clock is refused,
and a nonce seen within the window is refused. Nonces are remembered only after the signature
checks out, so unauthenticated traffic cannot fill the cache; the cache is bounded
(``max_nonces``) and a full cache refuses requests rather than forgetting early (fail closed).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Mapping

from tract_async.transport.errors import AuthenticationFailed, ReplayedRequest, TransportConfigError

H_AGENT = "X-Tract-Agent"
H_TIME = "X-Tract-Time"
H_NONCE = "X-Tract-Nonce"
H_SIG = "X-Tract-Signature"

_DOMAIN = b"tract-http-v1"
_NONCE_BYTES = 16


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


def _canonical(method: str, path: str, sender: str, ts: str, nonce: str, doc: bytes) -> bytes:
    return b"\n".join((_DOMAIN, method.upper().encode(), path.encode(), sender.encode(), ts.encode(),
                       nonce.encode(), hashlib.sha256(doc).hexdigest().encode()))


class Signer:
    """Produces the auth headers of one agent's outgoing requests."""

    def __init__(self, name: str, secret: bytes | None) -> None:
        self.name = name
        self._secret = secret

    def headers(self, method: str, path: str, doc: bytes) -> dict[str, str]:
        """Headers for one request; a fresh nonce and timestamp each call (never reuse them)."""
        ts = f"{time.time():.6f}"
        nonce = os.urandom(_NONCE_BYTES).hex()
        h = {H_AGENT: self.name, H_TIME: ts, H_NONCE: nonce}
        if self._secret is not None:
            h[H_SIG] = hmac.new(self._secret, _canonical(method, path, self.name, ts, nonce, doc),
                                hashlib.sha256).hexdigest()
        return h


class Verifier:
    """Checks incoming requests; owns the replay cache."""

    def __init__(self, secret: bytes | None, *, window_s: float = 30.0, max_nonces: int = 1 << 20) -> None:
        self._secret = secret
        self.window_s = window_s
        self.max_nonces = max_nonces
        # nonce -> monotonic expiry; insertion order is expiry order, so pruning pops from the front.
        self._seen: dict[str, float] = {}

    def sender(self, headers: Mapping[str, str]) -> str:
        """The claimed sender name (authenticated only once ``verify`` passed)."""
        return headers.get(H_AGENT, "")

    def precheck(self, headers: Mapping[str, str]) -> None:
        """Cheap checks before any body byte is read: headers present, timestamp in the window.

        Raises AuthenticationFailed (missing or malformed headers), ReplayedRequest (stale time).
        """
        if self._secret is None:
            return
        for h in (H_AGENT, H_TIME, H_NONCE, H_SIG):
            if not headers.get(h):
                raise AuthenticationFailed(f"missing {h} header: this agent requires signed requests")
        try:
            ts = float(headers[H_TIME])
        except ValueError:
            raise AuthenticationFailed(f"malformed {H_TIME} header") from None
        if not abs(time.time() - ts) <= self.window_s:  # also refuses NaN
            raise ReplayedRequest(f"request timestamp is outside the {self.window_s:g} s replay window")

    def verify(self, method: str, path: str, headers: Mapping[str, str], doc: bytes) -> None:
        """Full check: signature over the canonical request, then nonce freshness.

        Raises AuthenticationFailed (bad signature), ReplayedRequest (nonce seen, or cache full).
        """
        if self._secret is None:
            return
        self.precheck(headers)
        want = hmac.new(self._secret, _canonical(method, path, headers[H_AGENT], headers[H_TIME],
                                                 headers[H_NONCE], doc), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, headers[H_SIG]):
            raise AuthenticationFailed("request signature does not match: wrong shared secret or altered request")
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


__all__ = ["Signer", "Verifier", "key_id", "H_AGENT", "H_TIME", "H_NONCE", "H_SIG", "coerce_secret"]

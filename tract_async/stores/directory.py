"""The directory of the HTTP transport: which peer announced which block, and the wire form of
announcements (see ``stores/http.py`` for the protocol).

An entry ``key -> {peer: Held(slot, version, layer mask, complete)}`` is a *hint*: readers check
it with the holder after their READ, so a stale entry costs a miss, never wrong bytes. Changes
wake waiters through one ``asyncio.Event`` per generation (set on change, then replaced), so
``get_kv(timeout=)`` waits for announcements without polling.

Announce ops (orjson lists; every field is checked before any op of a batch is applied)::

    ["p", key_hex, slot, version, layer_mask_hex, complete]   a block (or more of its layers) landed
    ["e", key_hex, slot, version]                             that block is gone (LRU, consumed, ...)
    ["bye"]                                                   the sender closed: forget all of it
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from .pool import LocalBlock
from ..transport.errors import MalformedRequest

MAX_OPS = 1 << 16        # entries of one announce or check request


@dataclasses.dataclass
class Held:
    """A peer's block as announced: a hint until a check confirms it."""
    slot: int
    version: int
    mask: int
    complete: bool


def parse_key(v: Any) -> bytes:
    """A 32-byte block key from 64 hex characters. Raises MalformedRequest."""
    if not isinstance(v, str) or len(v) != 64:
        raise MalformedRequest(f"a block key is 64 hex characters, got {v!r:.80}")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise MalformedRequest(f"a block key is 64 hex characters, got {v!r:.80}") from None


def parse_uint(v: Any, what: str, limit: int = 1 << 62) -> int:
    """Raises MalformedRequest unless ``v`` is an int in [0, limit)."""
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
        raise MalformedRequest(f"{what} must be an int in [0, {limit}), got {v!r:.80}")
    return v


def ops_list(v: Any, what: str) -> list[Any]:
    """Raises MalformedRequest unless ``v`` is a list of at most MAX_OPS entries."""
    if not isinstance(v, list) or len(v) > MAX_OPS:
        raise MalformedRequest(f"{what} must be a list of at most {MAX_OPS} entries")
    return v


def put_op(key: bytes, b: LocalBlock) -> list[Any]:
    return ["p", key.hex(), b.slot, b.version, format(b.mask, "x"), b.complete]


def evict_op(key: bytes, b: LocalBlock) -> list[Any]:
    return ["e", key.hex(), b.slot, b.version]


def parse_ops(ops: list[Any], full_mask: int) -> list[tuple]:
    """Validate a whole batch before any of it is applied (bad input changes nothing).
    Raises MalformedRequest."""
    out: list[tuple] = []
    for op in ops:
        if not isinstance(op, list) or not op or not isinstance(op[0], str):
            raise MalformedRequest(f"announce op must be a list, got {op!r:.80}")
        if op[0] == "p" and len(op) == 6:
            try:
                mask = int(op[4], 16) if isinstance(op[4], str) and len(op[4]) <= 32 else -1
            except ValueError:
                mask = -1
            if not 0 <= mask <= full_mask or not isinstance(op[5], bool):
                raise MalformedRequest(f"announce put op has a bad layer mask: {op!r:.120}")
            out.append(("p", parse_key(op[1]), parse_uint(op[2], "slot"),
                        parse_uint(op[3], "version"), mask, op[5] and mask == full_mask))
        elif op[0] == "e" and len(op) == 4:
            out.append(("e", parse_key(op[1]), parse_uint(op[2], "slot"),
                        parse_uint(op[3], "version")))
        elif op[0] == "bye" and len(op) == 1:
            out.append(("bye",))
        else:
            raise MalformedRequest(f"unknown announce op {op!r:.80}")
    return out


class Directory:
    """Who holds what, as announced; event-driven waits on its changes."""

    def __init__(self) -> None:
        self.entries: dict[bytes, dict[str, Held]] = {}
        self._changed = asyncio.Event()

    def apply(self, peer: str, parsed: list[tuple]) -> bool:
        """Apply parsed ops from ``peer``; True if it said bye (the caller drops the peer)."""
        bye = False
        for op in parsed:
            if op[0] == "p":
                _, key, slot, version, mask, complete = op
                held = self.entries.setdefault(key, {}).get(peer)
                if held is not None and held.slot == slot and held.version == version:
                    # the same reservation: its layers only ever grow (a reordered or a second
                    # channel's older op must not take a landed layer back)
                    held.mask |= mask
                    held.complete = held.complete or complete
                else:
                    self.entries[key][peer] = Held(slot, version, mask, complete)
            elif op[0] == "e":
                held = self.entries.get(op[1], {}).get(peer)
                if held is not None and held.slot == op[2] and held.version == op[3]:
                    self.forget(op[1], peer)
            else:
                bye = True
        self.wake()
        return bye

    def add_layers(self, peer: str, parsed: list[tuple]) -> int:
        """Merge the layers of put ops into entries that already exist at the same slot and
        version; returns how many entries gained layers. For an unacknowledged fast channel
        (NIXL notifications): it never creates, resurrects or rewinds an entry, so a late or
        forged op changes nothing that the acknowledged announcements did not create."""
        changed = 0
        for op in parsed:
            if op[0] != "p":
                continue
            _, key, slot, version, mask, complete = op
            held = self.entries.get(key, {}).get(peer)
            if held is None or held.slot != slot or held.version != version:
                continue
            if held.mask | mask != held.mask or (complete and not held.complete):
                held.mask |= mask
                held.complete = held.complete or complete
                changed += 1
        if changed:
            self.wake()
        return changed

    def forget(self, key: bytes, peer: str, version: int | None = None) -> None:
        """Drop ``peer``'s entry for ``key`` (only at ``version`` when given)."""
        held = self.entries.get(key)
        if held is None or peer not in held:
            return
        if version is None or held[peer].version == version:
            del held[peer]
            if not held:
                del self.entries[key]

    def forget_peer(self, peer: str) -> None:
        for key in [k for k, held in self.entries.items() if peer in held]:
            self.forget(key, peer)
        self.wake()

    def wake(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def wait_changed(self) -> None:
        """Until the next change (check your condition before calling)."""
        await self._changed.wait()

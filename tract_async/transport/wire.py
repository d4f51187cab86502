"""Wire formats of the HTTP transport: agent metadata and the READ/WRITE request framing.

Metadata (``get_agent_metadata``)::

    offset  size  field
    0       8     magic  b"TRACTMD\\0"
    8       2     format version, little-endian u16 (checked before anything else is decoded)
    10      ...   orjson document {name, instance, host, port, auth, key_id, regions: [{name, addr,
                  nbytes, mem_type, dev_id, writable}]}

``instance`` is the random id of the agent's incarnation (``auth.new_instance``); every request
to the agent is signed for its name and instance (see ``auth``).

Format version history (increment whenever a field changes meaning or a required field appears):
    1  first version.
    2  ``instance`` (required): requests are signed for their recipient (tract-http-v2).

Identity (``GET /tract/v1/identity``, unsigned; how a sender that has only a URL learns whom to
sign the metadata fetch for): orjson {"protocol": "tract-http-v2", "name": ..., "instance": ...}.

Transfer request body (POST /tract/v1/read and /tract/v1/write)::

    0       4     doc_len, little-endian u32
    4       doc   orjson {"mem_type": "DRAM", "descs": [[addr, nbytes, dev_id], ...], "notif": base64}
    4+doc   ...   WRITE only: the payload, the descriptors' bytes back to back, in order

A READ response body is the descriptors' bytes back to back, in order, with a Content-Length.
An error response is JSON {"error": code, "message": text} with the code also in the
``X-Tract-Error`` header; ``errors.ERROR_CODES`` maps codes to exception classes.
"""
from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass

import orjson

from tract_async.transport.auth import PROTOCOL, is_instance
from tract_async.transport.descs import MEM_TYPES, RegionInfo
from tract_async.transport.errors import (
    MalformedRequest,
    MetadataError,
    MetadataVersionMismatch,
    RequestTooLarge,
)

MD_MAGIC = b"TRACTMD\x00"
MD_VERSION = 2
_MD_HEAD = struct.Struct("<8sH")
DOC_LEN = struct.Struct("<I")

PATH_READ = "/tract/v1/read"
PATH_WRITE = "/tract/v1/write"
PATH_NOTIF = "/tract/v1/notif"
PATH_METADATA = "/tract/v1/metadata"
PATH_IDENTITY = "/tract/v1/identity"
H_ERROR = "X-Tract-Error"

_U63 = (1 << 63) - 1


@dataclass(frozen=True, kw_only=True)
class AgentMetadata:
    """What one agent tells its peers: who it is, where it listens, what memory it exposes."""

    name: str
    instance: str        # random id of this incarnation (auth.new_instance)
    host: str
    port: int
    auth: str            # "hmac" or "none"
    key_id: str          # fingerprint of the shared secret (auth.key_id)
    regions: tuple[RegionInfo, ...]

    @property
    def http_host(self) -> str:
        """The Host header value: "host:port" (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://{self.http_host}"


def encode_metadata(md: AgentMetadata) -> bytes:
    doc = {
        "name": md.name, "instance": md.instance, "host": md.host, "port": md.port, "auth": md.auth,
        "key_id": md.key_id,
        "regions": [{"name": r.name, "addr": r.addr, "nbytes": r.nbytes, "mem_type": r.mem_type,
                     "dev_id": r.dev_id, "writable": r.writable} for r in md.regions],
    }
    return _MD_HEAD.pack(MD_MAGIC, MD_VERSION) + orjson.dumps(doc)


def _field(doc: dict, key: str, typ: type, what: str = "metadata") -> object:
    v = doc.get(key)
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise MetadataError(f"{what} field {key!r} must be {typ.__name__}, got {type(v).__name__}")
    return v


def decode_metadata(data: bytes) -> AgentMetadata:
    """Parse agent metadata, checking magic and version before decoding the document.

    Raises MetadataError (not tract metadata, bad JSON, missing or mistyped fields),
    MetadataVersionMismatch (another format version).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MetadataError(f"metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _MD_HEAD.size:
        raise MetadataError(f"metadata is {len(data)} bytes, shorter than its {_MD_HEAD.size}-byte header")
    magic, version = _MD_HEAD.unpack_from(data)
    if magic != MD_MAGIC:
        raise MetadataError(f"not tract agent metadata (magic {magic!r}, expected {MD_MAGIC!r})")
    if version != MD_VERSION:
        raise MetadataVersionMismatch(f"agent metadata format version {version}, this build reads {MD_VERSION}")
    try:
        doc = orjson.loads(data[_MD_HEAD.size:])
    except orjson.JSONDecodeError as e:
        raise MetadataError(f"agent metadata document is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise MetadataError("agent metadata document must be a JSON object")
    name = _field(doc, "name", str)
    port = _field(doc, "port", int)
    auth = _field(doc, "auth", str)
    if not name or len(name) > 256 or not (0 < port < 65536) or auth not in ("hmac", "none"):
        raise MetadataError(f"agent metadata has an invalid name, port or auth ({name!r}, {port}, {auth!r})")
    instance = _field(doc, "instance", str)
    if not is_instance(instance):
        raise MetadataError(f"agent metadata of {name!r} has an invalid instance id (32 hex digits expected)")
    regions = []
    for r in _field(doc, "regions", list):  # type: ignore[union-attr]
        if not isinstance(r, dict):
            raise MetadataError("each metadata region must be a JSON object")
        info = RegionInfo(name=_field(r, "name", str, "region"), addr=_field(r, "addr", int, "region"),
                          nbytes=_field(r, "nbytes", int, "region"), mem_type=_field(r, "mem_type", str, "region"),
                          dev_id=_field(r, "dev_id", int, "region"), writable=_field(r, "writable", bool, "region"))
        if info.mem_type not in MEM_TYPES or info.addr < 0 or info.nbytes <= 0 or info.dev_id < 0:
            raise MetadataError(f"metadata region {info.name!r} has invalid fields")
        regions.append(info)
    return AgentMetadata(name=name, instance=instance, host=_field(doc, "host", str),  # type: ignore[arg-type]
                         port=port, auth=auth,  # type: ignore[arg-type]
                         key_id=_field(doc, "key_id", str), regions=tuple(regions))  # type: ignore[arg-type]


def encode_identity(name: str, instance: str) -> bytes:
    return orjson.dumps({"protocol": PROTOCOL, "name": name, "instance": instance})


def decode_identity(data: bytes, source: str) -> tuple[str, str]:
    """The ``(name, instance)`` of an identity answer from ``source`` (a URL, for messages).

    Raises MetadataVersionMismatch (another protocol), MetadataError (not an identity answer).
    """
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise MetadataError(f"{source} answered its identity route with something other than a JSON object")
    if doc.get("protocol") != PROTOCOL:
        raise MetadataVersionMismatch(f"{source} speaks {str(doc.get('protocol'))[:40]!r}, this build {PROTOCOL!r}")
    name, instance = doc.get("name"), doc.get("instance")
    if not isinstance(name, str) or not name or len(name) > 256 or not is_instance(instance):
        raise MetadataError(f"{source} answered its identity route with an invalid name or instance")
    return name, instance  # type: ignore[return-value]


def encode_doc(rows: list[list[int]], mem_type: str, notif: bytes) -> bytes:
    return orjson.dumps({"mem_type": mem_type, "descs": rows, "notif": base64.b64encode(notif).decode()})


@dataclass(frozen=True, kw_only=True)
class TransferDoc:
    rows: list[list[int]]
    mem_type: str
    notif: bytes
    total_bytes: int


def decode_doc(doc: bytes, *, max_descs: int, max_total_bytes: int, max_notif_bytes: int) -> TransferDoc:
    """Parse and type-check a transfer document; nothing here trusts the peer.

    Raises MalformedRequest (not the documented shape), RequestTooLarge (over a limit).
    """
    try:
        d = orjson.loads(doc)
    except orjson.JSONDecodeError as e:
        raise MalformedRequest(f"transfer document is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise MalformedRequest("transfer document must be a JSON object")
    mem_type, rows, notif = d.get("mem_type"), d.get("descs"), d.get("notif", "")
    if mem_type not in MEM_TYPES:
        raise MalformedRequest(f"mem_type must be one of {MEM_TYPES}")
    if not isinstance(rows, list) or not rows:
        raise MalformedRequest("descs must be a non-empty list of [addr, nbytes, dev_id]")
    if len(rows) > max_descs:
        raise RequestTooLarge(f"{len(rows)} descriptors, the limit is {max_descs}")
    total = 0
    for row in rows:
        if (not isinstance(row, list) or len(row) != 3
                or not all(type(v) is int and 0 <= v <= _U63 for v in row) or row[1] == 0):
            raise MalformedRequest("each descriptor must be [addr, nbytes > 0, dev_id] of non-negative integers")
        total += row[1]
    if total > max_total_bytes:
        raise RequestTooLarge(f"transfer of {total} bytes, the limit is {max_total_bytes}")
    if not isinstance(notif, str):
        raise MalformedRequest("notif must be a base64 string")
    try:
        notif_b = base64.b64decode(notif, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedRequest("notif is not valid base64") from None
    if len(notif_b) > max_notif_bytes:
        raise RequestTooLarge(f"notification of {len(notif_b)} bytes, the limit is {max_notif_bytes}")
    return TransferDoc(rows=rows, mem_type=mem_type, notif=notif_b, total_bytes=total)


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps({"error": code, "message": message})

"""The refit wire protocol in one place: message kinds, framing, one bounded decode, and validators.

Why one module: the trainer (``Sender``, ``ControlClient``, ``ControlFanOut``) and the engine
(``Receiver``) must agree on every message, and each must treat what the other sends as
untrusted bytes. Both sides use the names, the decode and the validators defined here.

Framing: one zmq frame = the 32-byte session token, then one msgpack map. The token is compared
(``hmac.compare_digest``) before a byte of the map is decoded, so a stranger's frame costs a
comparison, never a decode. A rejection (the engine's answer to a stranger) is the one frame
without the token. Decoding is bounded: msgpack's own length limits per string, binary, array
and map, no extension types, and a nesting depth of ``MAX_DEPTH`` checked on the decoded value
without recursion.

Validators: ``check_request`` (engine side) and ``check_reply`` (trainer side) check each message
kind's fields and types, so handlers read fields that exist and have the right type; a failure
raises ``Malformed`` naming the message and field. Strings a peer sends to be shown to a person
(``why``, ``problems``, ``error``) are cut to ``MAX_TEXT_CHARS``.
"""

from __future__ import annotations

import hmac
from typing import Any

import msgpack

from mxrefit.errors import MxrefitError

BYTESUM_MOD = 65521  # the modulus of the "checksum" reply's weighted sum (transport/bytesum.py)
MAX_BUFFERS = 1024  # the most transfer buffers a description may name
MAX_BUFFER_BYTES = 1 << 44  # the largest buffer a description may claim


class Op:
    """Message kinds (the ``op`` field). Requests go trainer → engine, replies engine → trainer."""

    # requests
    HELLO = "hello"
    PLAN = "plan"
    BEGIN = "begin"
    READY = "ready"
    COMMIT = "commit"
    ABORT = "abort"
    STATUS = "status"
    CHECKSUM = "checksum"
    SHUTDOWN = "shutdown"
    # replies
    TABLES = "tables"
    PLANNED = "planned"
    BEGUN = "begun"
    APPLIED = "applied"
    COMMITTED = "committed"
    ABORTED = "aborted"
    BYE = "bye"
    ERROR = "error"
    REJECTED = "rejected"


OP = "op"
SEQ = "seq"  # the client's number of a request
RE = "re"  # the request number a reply answers
MAX_SEQ = 2**63 - 1

MAX_DEPTH = 16  # the deepest honest message (tables: map > list > row > targets > target > shape) is 6
MAX_STR_BYTES = 4 << 20  # an abort's reason may be long; it is cut before it is shown
MAX_BIN_BYTES = 1 << 20  # CUDA IPC handles are tens of bytes
MAX_ARRAY_LEN = 1 << 20  # a plan of a 235B MoE names ~40k tensors
MAX_MAP_LEN = 64  # every message is a small map
MAX_TEXT_CHARS = 1000  # what a peer's free text may add to an error message
MAX_PROBLEMS = 20
MAX_REJECTION_BYTES = 1024  # an unauthenticated rejection is read only this far


class Malformed(MxrefitError, ValueError):
    """A frame or message that breaks the protocol; ``why`` is short and safe to log or send back."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why[:MAX_TEXT_CHARS]


# ---- framing ---------------------------------------------------------------------------------
def encode(msg: dict[str, Any]) -> bytes:
    """msgpack of plain data (bytes stay bytes); TypeError for anything else."""
    return msgpack.packb(msg, use_bin_type=True)


def frame(token: bytes, msg: dict[str, Any]) -> bytes:
    """The authenticated frame for ``msg``: the token, then the map."""
    return token + encode(msg)


def authenticated_body(data: bytes, token: bytes) -> bytes | None:
    """The map's bytes if ``data`` starts with ``token`` (constant-time compare), else None."""
    return data[len(token) :] if hmac.compare_digest(data[: len(token)], token) else None


def decode(body: bytes) -> dict[str, Any]:
    """One bounded decode of a message map with a str ``op``; Malformed for anything else."""
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_BIN_BYTES,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except Exception as err:  # msgpack raises several types (ValueError, ExtraData, FormatError, StackError, ...)
        raise Malformed(f"undecodable frame: {type(err).__name__}: {err}") from None
    if not isinstance(obj, dict):
        raise Malformed(f"frame is a msgpack {type(obj).__name__}, not a map")
    depth = nesting(obj)
    if depth > MAX_DEPTH:
        raise Malformed(f"undecodable frame: nested {depth} deep, over the {MAX_DEPTH} limit")
    if not isinstance(obj.get(OP), str):
        raise Malformed("missing or non-string 'op'")
    return obj


def decode_rejection(data: bytes) -> dict[str, Any] | None:
    """A tokenless ``rejected`` answer ({op, why}), or None if ``data`` is not one."""
    if len(data) > MAX_REJECTION_BYTES:
        return None
    try:
        obj = decode(data)
    except Malformed:
        return None
    if obj.get(OP) != Op.REJECTED or set(obj) - {OP, "why"}:
        return None
    return {OP: Op.REJECTED, "why": text(obj.get("why"))}


def nesting(obj: Any) -> int:
    """How deep lists and maps nest in ``obj`` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            return depth
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def text(value: Any) -> str:
    """A peer's free text, cut to ``MAX_TEXT_CHARS`` (non-strings shown by repr)."""
    s = value if isinstance(value, str) else repr(value)
    return s if len(s) <= MAX_TEXT_CHARS else s[:MAX_TEXT_CHARS] + f"... ({len(s)} chars)"


def number(msg: dict[str, Any], key: str) -> int | None:
    """The message number under ``key`` (``seq`` or ``re``), removed from ``msg``; Malformed if not an int in range."""
    n = msg.pop(key, None)
    if n is not None and not (is_int(n) and 0 <= n <= MAX_SEQ):
        raise Malformed(f"'{key}' must be an int in [0, 2**63), got {n!r:.40}")
    return n


# ---- field types -----------------------------------------------------------------------------
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(x) for x in value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def _optional(check):
    return lambda v: v is None or check(v)


_INT, _STR, _NUM, _BOOL = is_int, (lambda v: isinstance(v, str)), _is_num, (lambda v: isinstance(v, bool))
_LIST, _DICT = (lambda v: isinstance(v, list)), (lambda v: isinstance(v, dict))


def _STATE(v: Any) -> bool:
    return v in ("ready", "partial", "lost")


# per kind: field -> (check, required). Extra fields are allowed (a newer peer may add some).
_STATUS_FIELDS = {
    "version": (_INT, True),
    "state": (_STATE, True),
    "error": (_optional(_STR), False),
    "rejected": (_INT, False),
    "ranks": (_LIST, False),
}
REQUESTS: dict[str, dict[str, tuple[Any, bool]]] = {
    Op.HELLO: {},
    Op.PLAN: {
        "sources": (_LIST, True),
        "bucket_bytes": (_INT, True),
        "slots": (_INT, True),
        "write_ahead": (_INT, False),
        "digest": (_STR, True),
        "plan_id": (_optional(_STR), False),
        "transport": (_STR, False),
        "verify": (_optional(_BOOL), False),
        "buffers": (_DICT, False),
    },
    Op.BEGIN: {
        "version": (_INT, True),
        "digest": (_STR, True),
        "plan_id": (_optional(_STR), False),
        "adoptions": (_optional(_is_str_list), False),
    },
    Op.READY: {"version": (_INT, True), "bucket": (_INT, True), "sum": (_optional(_is_int_list), False)},
    Op.COMMIT: {"version": (_INT, True)},
    Op.ABORT: {"version": (_optional(_INT), False), "why": (lambda v: True, False)},
    Op.STATUS: {},
    Op.CHECKSUM: {"ranges": (_LIST, True)},
    Op.SHUTDOWN: {},
}
REPLIES: dict[str, dict[str, tuple[Any, bool]]] = {
    Op.TABLES: {
        "params": (_LIST, True),
        "destinations": (_LIST, True),
        "exportable": (_BOOL, True),
        "device": (_STR, True),
        "tables": (_INT, False),  # the engine's tables version (Engine.tables_version); absent from older engines
        "orders": (_LIST, False),  # learned orders' tables, once each (plan/build.py tables_to_msg)
        **_STATUS_FIELDS,
    },
    Op.PLANNED: {
        "digest": (_STR, True),
        "adoption": (lambda v: isinstance(v, str) or _is_str_list(v), True),
        "exports": (_DICT, False),
    },
    Op.BEGUN: {"version": (_INT, True)},
    Op.APPLIED: {"bucket": (_INT, True)},
    Op.COMMITTED: {
        **_STATUS_FIELDS,
        "fetch_s": (_NUM, False),
        "apply_s": (_NUM, False),
        "process_s": (_NUM, False),
        "after_refit_s": (_NUM, False),
        "tables": (_INT, False),  # changed since "tables": plan again before the next refit
    },
    Op.ABORTED: _STATUS_FIELDS,
    Op.STATUS: _STATUS_FIELDS,
    Op.BYE: _STATUS_FIELDS,
    Op.CHECKSUM: {"sha256": (lambda v: isinstance(v, list) and all(x is None or isinstance(x, str) for x in v), True)},
    Op.ERROR: {
        "kind": (_STR, True),
        "problems": (_LIST, True),
        "version": (_optional(_INT), False),
        "state": (_optional(_STATE), False),
    },
    Op.REJECTED: {"why": (lambda v: True, False)},
}


def _check(msg: dict[str, Any], spec: dict[str, tuple[Any, bool]], what: str) -> dict[str, Any]:
    for key, (ok, required) in spec.items():
        if key not in msg:
            if required:
                raise Malformed(f"{what} {msg[OP]!r} lacks its {key!r} field")
        elif not ok(msg[key]):
            raise Malformed(f"{what} {msg[OP]!r} has a bad {key!r} field: {text(repr(msg[key]))[:80]}")
    return msg


def check_request(msg: dict[str, Any]) -> dict[str, Any]:
    """A known request whose fields have their types; Malformed otherwise. ``why`` is cut to size."""
    spec = REQUESTS.get(msg[OP])
    if spec is None:
        raise Malformed(f"unknown op {msg[OP]!r:.40}")
    _check(msg, spec, "request")
    if "why" in msg:
        msg["why"] = text(msg["why"])
    return msg


def check_reply(msg: dict[str, Any], *expected: str) -> dict[str, Any]:
    """A reply of one of the ``expected`` kinds (or ``error``/``rejected``) with well-typed fields.

    Free text (``why``, ``error``, each of ``problems``) is cut to size so a hostile engine cannot
    turn its reply into an unbounded error message on the trainer.
    """
    op = msg[OP]
    if op not in (*expected, Op.ERROR, Op.REJECTED):
        raise Malformed(f"answered {op!r:.40} where {' or '.join(map(repr, expected))} was due")
    _check(msg, REPLIES[op], "reply")
    for key in ("why", "error"):
        if msg.get(key) is not None:
            msg[key] = text(msg[key])
    if "problems" in msg:
        if not isinstance(msg["problems"], list):
            raise Malformed(f"reply {op!r} has a bad 'problems' field: {text(repr(msg['problems']))[:80]}")
        problems = [text(p) for p in msg["problems"][:MAX_PROBLEMS]]
        if len(msg["problems"]) > MAX_PROBLEMS:
            problems.append(f"... and {len(msg['problems']) - MAX_PROBLEMS} more")
        msg["problems"] = problems
    return msg


# ---- field validators, shared by every message and buffer description reader ----------------
def check_int(value: Any, name: str, low: int, high: int) -> int:
    """``value`` as an int in [low, high], else ValueError (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def check_keys(desc: dict[str, Any], expected: set[str]) -> None:
    """Exact key set, so a truncated or foreign description fails loudly instead of half-working."""
    missing = expected - desc.keys()
    extra = desc.keys() - expected
    if missing or extra:
        raise ValueError(
            f"bad {desc.get('kind')!r} buffer description: missing keys {sorted(missing)}, "
            f"unexpected keys {sorted(map(str, extra))}"
        )


def check_list(value: Any, name: str) -> list[Any]:
    """A non-empty list of at most MAX_BUFFERS entries."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BUFFERS:
        raise ValueError(f"{name} must be a list of 1..{MAX_BUFFERS} entries, got {value!r:.200}")
    return value

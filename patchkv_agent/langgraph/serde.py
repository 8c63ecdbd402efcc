"""An allowlist deserializer for LangGraph checkpoint blobs read from outside the process.

LangGraph's default ``JsonPlusSerializer`` rebuilds whatever class a msgpack blob names (module, name,
arguments: ``importlib`` + call), so a checkpoint database someone sent you can run code when it is
read. :class:`AllowlistSerializer` reads the same formats but builds only:

- LangChain message classes (``AIMessage``, ``HumanMessage``, ``SystemMessage``, ``ToolMessage``,
  ``ChatMessage``, ``FunctionMessage``, ``RemoveMessage`` and their chunks), from keyword data through
  their pydantic validation;
- plain data: ``None``, bools, numbers, strings, bytes, lists, dicts, and the value types LangGraph
  itself writes for them (``uuid.UUID``, ``decimal.Decimal``, ``datetime`` date/time/datetime/timedelta/
  timezone, ``set``/``frozenset``/``deque``), each built by a fixed constructor here, never looked up
  by the name in the blob.

Anything else (another class, a method call, a NumPy array, pickle, a LangChain ``secret`` or a
non-message ``constructor`` in the old JSON format, malformed or over-deep data, a blob larger than
``max_blob_bytes``) raises :class:`UntrustedCheckpointError` naming what was refused: no object is
built from a name in the data and no import runs.

Decoding is bounded before it starts: a msgpack blob is walked once without building anything (every
value counted, extension payloads included; every container's declared length checked against the bytes
left, since each element takes at least one), a JSON blob's values are counted by one pass over its
tokens, and a blob of more than ``max_objects`` values (default :data:`MAX_OBJECTS`) or nested deeper than
200 is refused unread. A blob's decoded memory is then at most its size plus about 100 bytes per value,
so a few kilobytes of empty maps can no longer cost gigabytes. Writing (``dumps_typed``) is LangGraph's own
encoder, so a saver built with ``serde=AllowlistSerializer()`` writes what any LangGraph reader reads.

Knows LangGraph's serialization formats and LangChain's message classes; nothing about models.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import json
import re
import uuid
from collections import deque
from typing import Any, Callable

__all__ = ["AllowlistSerializer", "UntrustedCheckpointError", "MAX_BLOB_BYTES", "MAX_OBJECTS", "msgpack_census",
           "json_census"]

MAX_BLOB_BYTES = 256 << 20  # one checkpoint blob; larger ones are refused before they are decoded
MAX_OBJECTS = 1_000_000  # values in one blob (a 5,000-message history is ~100k); more are refused undecoded
_MAX_DEPTH = 200  # nesting of decoded containers (msgpack and JSON alike)

# msgpack extension codes of langgraph.checkpoint.serde.jsonplus
_EXT_SINGLE, _EXT_POS, _EXT_KW, _EXT_METHOD, _EXT_PYD1, _EXT_PYD2, _EXT_NUMPY, _EXT_DELTA = range(8)


class UntrustedCheckpointError(ValueError):
    """A checkpoint blob holds something outside the allowlist, or cannot be decoded at all."""


def _message_classes() -> dict[tuple[str, str], type]:
    from langchain_core import messages as m

    names = ["AIMessage", "HumanMessage", "SystemMessage", "ToolMessage", "ChatMessage", "FunctionMessage",
             "AIMessageChunk", "HumanMessageChunk", "SystemMessageChunk", "ToolMessageChunk", "ChatMessageChunk",
             "FunctionMessageChunk", "RemoveMessage"]
    return {(getattr(m, n).__module__, n): getattr(m, n) for n in names}


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data (what a JSON/msgpack decode gives, plus the allowlisted values)."""
    if depth > _MAX_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, float, str, bytes, uuid.UUID, decimal.Decimal,
                                           _dt.date, _dt.time, _dt.timedelta, _dt.tzinfo)):
        return True
    if isinstance(value, (list, tuple, set, frozenset, deque)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return _is_message(value)


def _is_message(value: Any) -> bool:
    from langchain_core.messages import BaseMessage

    return isinstance(value, BaseMessage)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise UntrustedCheckpointError(what)


def _ints(args: Any, n_min: int, n_max: int, what: str) -> tuple[int, ...]:
    _need(isinstance(args, (list, tuple)) and n_min <= len(args) <= n_max
          and all(isinstance(a, int) and not isinstance(a, bool) for a in args), f"malformed {what} arguments")
    return tuple(args)


def _build_value(module: str, name: str, arg: Any, *, code: int) -> Any:
    """The allowlisted plain-data values, each from a fixed constructor (never looked up by name)."""
    key = (module, name)
    try:
        if key == ("uuid", "UUID") and code == _EXT_SINGLE:
            _need(isinstance(arg, str) and len(arg) <= 64, "malformed UUID")
            return uuid.UUID(hex=arg)
        if key == ("decimal", "Decimal") and code == _EXT_SINGLE:
            _need(isinstance(arg, str) and len(arg) <= 4096, "malformed Decimal")
            return decimal.Decimal(arg)
        if key in (("builtins", "set"), ("builtins", "frozenset"), ("collections", "deque")) and code == _EXT_SINGLE:
            _need(isinstance(arg, (list, tuple)), f"malformed {name}")
            return {"set": set, "frozenset": frozenset, "deque": deque}[name](arg)
        if key == ("datetime", "datetime") and code == _EXT_METHOD:
            _need(isinstance(arg, str) and len(arg) <= 64, "malformed datetime")
            return _dt.datetime.fromisoformat(arg)
        if key == ("datetime", "date") and code == _EXT_POS:
            return _dt.date(*_ints(arg, 3, 3, "date"))
        if key == ("datetime", "timedelta") and code == _EXT_POS:
            return _dt.timedelta(*_ints(arg, 3, 3, "timedelta"))
        if key == ("datetime", "time") and code == _EXT_KW:
            _need(isinstance(arg, dict) and set(arg) <= {"hour", "minute", "second", "microsecond", "tzinfo", "fold"},
                  "malformed time")
            tz = arg.get("tzinfo")
            _need(tz is None or isinstance(tz, _dt.tzinfo), "malformed time zone")
            nums = {k: v for k, v in arg.items() if k != "tzinfo"}
            _need(all(isinstance(v, int) and not isinstance(v, bool) for v in nums.values()), "malformed time")
            return _dt.time(**nums, tzinfo=tz)
        if key == ("datetime", "timezone") and code == _EXT_POS:
            _need(isinstance(arg, (list, tuple)) and 1 <= len(arg) <= 2 and isinstance(arg[0], _dt.timedelta)
                  and (len(arg) == 1 or isinstance(arg[1], str)), "malformed timezone")
            return _dt.timezone(*arg)
    except (ValueError, TypeError, OverflowError, decimal.DecimalException) as e:
        raise UntrustedCheckpointError(f"malformed {module}.{name} value: {e}") from None
    return _REFUSED


_REFUSED = object()

# msgpack first bytes -> (payload length field size, fixed payload size) of the scalar formats
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}  # bin8/16/32, str8/16/32: length bytes
_EXT_SIZED = {0xc7: 1, 0xc8: 2, 0xc9: 4}  # ext8/16/32: length bytes (then a type byte)
_FIXEXT = {0xd4: 1, 0xd5: 2, 0xd6: 4, 0xd7: 8, 0xd8: 16}
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}  # array16/32, map16/32: (bytes, per item)


def msgpack_census(blob: bytes, *, max_objects: int = MAX_OBJECTS, max_depth: int = _MAX_DEPTH) -> int:
    """Count the values of one msgpack document without building any (extension payloads of LangGraph's
    codes 0-7 are msgpack too and counted), refusing it as soon as it cannot be decoded cheaply.

    Args:
        blob: the document.
        max_objects: values allowed (containers, scalars and extension values alike).
        max_depth: container and extension nesting allowed.

    Returns:
        The number of values.

    Raises:
        UntrustedCheckpointError: more than ``max_objects`` values, deeper than ``max_depth``, a container
            whose declared length exceeds the bytes left (each element takes at least one), a truncated or
            malformed document, or bytes after it.
    """
    count = 0

    def walk(start: int, end: int, depth: int) -> int:
        """Walk exactly one document in ``blob[start:end]``; returns its end."""
        nonlocal count
        pos = start
        stack = [1]  # values still to read at each open container level
        while stack:
            if stack[-1] == 0:
                stack.pop()
                continue
            stack[-1] -= 1
            if pos >= end:
                raise UntrustedCheckpointError("truncated msgpack blob")
            count += 1
            if count > max_objects:
                raise UntrustedCheckpointError(
                    f"a checkpoint blob holds more than {max_objects} values (refused before decoding: it could "
                    "take far more memory than its size); pass AllowlistSerializer(max_objects=...) to read it")
            b = blob[pos]
            pos += 1
            items = -1
            if b <= 0x7f or b >= 0xe0:
                continue
            if 0x80 <= b <= 0x8f:
                items = 2 * (b & 0x0f)
            elif 0x90 <= b <= 0x9f:
                items = b & 0x0f
            elif 0xa0 <= b <= 0xbf:
                pos += b & 0x1f
            elif b in _FIXED:
                pos += _FIXED[b]
            elif b in _SIZED:
                w = _SIZED[b]
                pos += w + int.from_bytes(blob[pos:pos + w], "big")
            elif b in _CONTAINERS:
                w, per = _CONTAINERS[b]
                items = per * int.from_bytes(blob[pos:pos + w], "big")
                pos += w
            elif b in _EXT_SIZED or b in _FIXEXT:
                if b in _EXT_SIZED:
                    w = _EXT_SIZED[b]
                    n = int.from_bytes(blob[pos:pos + w], "big")
                    pos += w
                else:
                    n = _FIXEXT[b]
                if pos + 1 + n > end:
                    raise UntrustedCheckpointError("truncated msgpack extension in a checkpoint blob")
                code = blob[pos]
                pos += 1
                if code <= _EXT_DELTA:  # LangGraph's payloads are msgpack documents themselves
                    if depth + len(stack) > max_depth:
                        raise UntrustedCheckpointError(f"a checkpoint blob nests deeper than {max_depth}")
                    if walk(pos, pos + n, depth + len(stack)) != pos + n:
                        raise UntrustedCheckpointError("malformed msgpack extension (bytes after its value)")
                pos += n
            else:
                raise UntrustedCheckpointError(f"not a valid msgpack blob (byte 0x{b:02x} at {pos - 1})")
            if pos > end:
                raise UntrustedCheckpointError("truncated msgpack blob")
            if items > 0:
                if items > end - pos:
                    raise UntrustedCheckpointError(
                        f"a msgpack container in a checkpoint blob declares {items} elements, more than the "
                        f"{end - pos} bytes left (damaged or hostile)")
                if depth + len(stack) >= max_depth:
                    raise UntrustedCheckpointError(f"a checkpoint blob nests deeper than {max_depth}")
                stack.append(items)
        return pos

    end = walk(0, len(blob), 0)
    if end != len(blob):
        raise UntrustedCheckpointError(f"not a valid msgpack blob ({len(blob) - end} bytes after its value)")
    return count


# one token after another, never restarting inside a string: a string, a value-opening or separating
# character (counted), a run of anything else (not counted), or a quote that opens no complete string
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{,]|[^"\[{,]+|"', re.S)


def json_census(blob: bytes, *, max_objects: int = MAX_OBJECTS) -> int:
    """An upper bound of the values in a JSON document (each string, container and separator), found by
    one linear pass over its tokens without building anything.

    Args:
        blob: the document.
        max_objects: values allowed.

    Returns:
        The bound (the pass stops at an unterminated string, which the decoder then refuses).

    Raises:
        UntrustedCheckpointError: more than ``max_objects`` values.
    """
    count = 0
    for m in _JSON_TOKEN.finditer(blob):
        first = blob[m.start()]
        if first == 0x22 and m.end() - m.start() == 1:
            break  # an unterminated string: invalid JSON, refused by the decoder
        if first in (0x22, 0x5B, 0x7B, 0x2C):
            count += 1
            if count > max_objects:
                raise UntrustedCheckpointError(
                    f"a JSON checkpoint blob holds more than {max_objects} values (refused before decoding: it "
                    "could take far more memory than its size); pass AllowlistSerializer(max_objects=...) to read it")
    return count


class AllowlistSerializer:
    """A LangGraph ``SerializerProtocol`` that reads LangChain messages and plain data only.

    Args:
        max_blob_bytes: largest blob :meth:`loads_typed` decodes.
        max_objects: most values one blob may hold (counted before it is decoded; see :func:`msgpack_census`).

    Use it wherever a checkpoint blob comes from outside the process, e.g.
    ``SqliteSaver(conn, serde=AllowlistSerializer())``; ``patchkv-agent replay --from-checkpointer``
    reads databases through it.
    """

    def __init__(self, *, max_blob_bytes: int = MAX_BLOB_BYTES, max_objects: int = MAX_OBJECTS):
        self.max_blob_bytes = int(max_blob_bytes)
        self.max_objects = int(max_objects)
        self._messages = _message_classes()

    # ------------------------------------------------------------------ writing: LangGraph's own encoder

    def dumps_typed(self, obj: Any) -> tuple[str, bytes]:
        """``(type, bytes)`` as LangGraph's ``JsonPlusSerializer`` writes it."""
        from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

        return JsonPlusSerializer().dumps_typed(obj)

    # ------------------------------------------------------------------ reading: the allowlist

    def loads_typed(self, data: tuple[str, bytes]) -> Any:
        """Decode one ``(type, bytes)`` blob.

        Args:
            data: the blob's type tag (``msgpack``, ``json``, ``bytes``, ``bytearray``, ``null``) and bytes.

        Returns:
            Plain data and LangChain messages.

        Raises:
            UntrustedCheckpointError: (a ``ValueError``) a class, method call, array, pickle or secret
                outside the allowlist, an unknown type tag, malformed or over-deep data, a blob larger
                than ``max_blob_bytes`` or holding more than ``max_objects`` values, or a container declaring
                more elements than bytes left; the message names what was refused.
        """
        try:
            type_, blob = data
        except (TypeError, ValueError):
            raise UntrustedCheckpointError("a checkpoint blob must be a (type, bytes) pair") from None
        if type_ == "null":
            return None
        if isinstance(blob, memoryview):
            blob = blob.tobytes()
        if not isinstance(blob, (bytes, bytearray)):
            raise UntrustedCheckpointError(f"a {type_!r} checkpoint blob must be bytes, got {type(blob).__name__}")
        if len(blob) > self.max_blob_bytes:
            raise UntrustedCheckpointError(f"a checkpoint blob of {len(blob)} bytes is over the limit of "
                                           f"{self.max_blob_bytes} bytes")
        if type_ == "bytes":
            return bytes(blob)
        if type_ == "bytearray":
            return bytearray(blob)
        if type_ == "msgpack":
            return self._msgpack(bytes(blob))
        if type_ == "json":
            return self._json(bytes(blob))
        if type_ == "pickle":
            raise UntrustedCheckpointError("refused a pickle checkpoint blob (unpickling runs code); only msgpack "
                                           "and JSON blobs of LangChain messages and plain data are read")
        raise UntrustedCheckpointError(f"unknown checkpoint blob type {str(type_)[:40]!r}")

    def _message(self, module: Any, name: Any, kwargs: Any) -> Any:
        cls = self._messages.get((module, name)) if isinstance(module, str) and isinstance(name, str) else None
        if cls is None:
            return _REFUSED
        _need(isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs),
              f"malformed {name} data (expected a dict of fields)")
        _need(_plain(kwargs), f"{name} data holds something other than plain data")
        try:
            return cls(**kwargs)
        except Exception as e:  # pydantic's validation of hostile fields
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UntrustedCheckpointError(f"invalid {name} data: {first}") from None

    def _msgpack(self, blob: bytes) -> Any:
        import ormsgpack

        refused: list[str] = []  # ormsgpack replaces an ext_hook's exception by its own: keep ours

        def hook(code: int, payload: bytes) -> Any:
            try:
                return self._ext(code, payload, unpack)
            except UntrustedCheckpointError as e:
                refused.append(str(e))
                raise

        def unpack(b: bytes) -> Any:
            return ormsgpack.unpackb(b, ext_hook=hook, option=ormsgpack.OPT_NON_STR_KEYS)

        msgpack_census(blob, max_objects=self.max_objects)  # before anything is built
        try:
            value = unpack(blob)
        except (ValueError, TypeError, RecursionError, OverflowError) as e:
            raise UntrustedCheckpointError(refused[0] if refused else f"not a valid msgpack blob ({e})") from None
        _need(_plain(value), "decoded blob holds something other than plain data and messages (or nests too deep)")
        return value

    def _ext(self, code: int, payload: bytes, unpack: Callable[[bytes], Any]) -> Any:
        if code == _EXT_DELTA:
            return unpack(payload)  # a snapshot of a channel's value: plain data inside
        if code == _EXT_NUMPY:
            raise UntrustedCheckpointError("refused a NumPy array in a checkpoint blob (plain data and LangChain "
                                           "messages only)")
        if code not in (_EXT_SINGLE, _EXT_POS, _EXT_KW, _EXT_METHOD, _EXT_PYD1, _EXT_PYD2):
            raise UntrustedCheckpointError(f"unknown msgpack extension {code} in a checkpoint blob")
        tup = unpack(payload)
        _need(isinstance(tup, (list, tuple)) and len(tup) >= 3 and isinstance(tup[0], str) and isinstance(tup[1], str),
              "malformed msgpack extension (expected module, name, arguments)")
        module, name, arg = tup[0][:200], tup[1][:200], tup[2]
        if code in (_EXT_PYD1, _EXT_PYD2, _EXT_KW):
            msg = self._message(module, name, arg)
            if msg is not _REFUSED:
                return msg
        if code == _EXT_METHOD:
            method = tup[3] if len(tup) > 3 else None
            if (module, name, method) != ("datetime", "datetime", "fromisoformat"):
                raise UntrustedCheckpointError(f"refused to call {module}.{name}.{str(method)[:200]} from a "
                                               "checkpoint blob (not in the allowlist: LangChain messages and plain data)")
        value = _build_value(module, name, arg, code=code)
        if value is _REFUSED:
            raise UntrustedCheckpointError(f"refused to build {module}.{name} from a checkpoint blob (not in the "
                                           "allowlist: LangChain messages and plain data)")
        return value

    def _json(self, blob: bytes) -> Any:
        def hook(obj: dict) -> Any:
            if "lc" not in obj or "type" not in obj:
                return obj
            kind, ids = obj.get("type"), obj.get("id")
            _need(isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids),
                  "malformed LangChain object in a JSON checkpoint blob")
            dotted = ".".join(ids)[:200]
            if kind != "constructor":
                raise UntrustedCheckpointError(f"refused a LangChain {str(kind)[:40]!r} object ({dotted}) in a "
                                               "checkpoint blob")
            name = ids[-1]
            legacy = ids[:-1] in (["langchain", "schema", "messages"], ["langchain_core", "messages"])
            module = next((m for (m, n) in self._messages if n == name), None) if legacy else ".".join(ids[:-1])
            msg = self._message(module, name, obj.get("kwargs", {}))
            if msg is _REFUSED:
                raise UntrustedCheckpointError(f"refused to build {dotted} from a checkpoint blob (not in the "
                                               "allowlist: LangChain messages and plain data)")
            return msg

        json_census(blob, max_objects=self.max_objects)  # before anything is built
        try:
            value = json.loads(blob, object_hook=hook)
        except UntrustedCheckpointError:
            raise
        except (ValueError, RecursionError) as e:
            raise UntrustedCheckpointError(f"not a valid JSON blob ({str(e)[:200]})") from None
        _need(_plain(value), "decoded JSON blob nests too deep")
        return value

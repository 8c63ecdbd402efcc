"""The JSON tool-call protocol for chat templates without tool support, and a tolerant parser.

Protocol (appended to the system prompt when tools are bound and the chat template ignores ``tools=``):
the model lists the tools as JSON schemas and is asked to reply, to call one, with exactly::

    <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>

which is also how :func:`plain_messages` writes earlier calls back into the context (tool results as
``<tool_response>...</tool_response>``), so a call the model wrote and the same call re-rendered are the
same text. This module owns those tags: the chat model, the trace replay (:mod:`patchkv_agent.eval.traces`)
and the calibration tools all render trace messages through :func:`plain_messages`; the chat model breaks
the tags (:data:`PROTOCOL_TAGS`) inside message text first, so a tool result holding ``</tool_response>``
cannot close its wrapper.

:func:`parse_tool_calls` reads model output tolerantly: tagged calls (also an unterminated last one),
bare JSON objects with ``name`` and ``arguments``/``args``/``parameters`` (also in code fences, also
``{"function": {...}}``), arguments given as a JSON string, Python-literal dicts; truncated JSON is
never repaired into a call (an agent would run a tool with wrong arguments); what cannot be read becomes
an ``invalid_tool_calls`` entry, never an exception.

Also converts LangChain messages to the message dicts of the trace format (``docs/TRACES.md``), checking
that their text is text a tokenizer encodes (:func:`check_text`, :func:`check_json_text`: a ``ValueError``
naming the field). Knows
LangChain message classes (imported lazily: the tags and :func:`plain_messages` need no LangChain); nothing
about models, the engine or evaluation.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    from langchain_core.messages import BaseMessage

# langchain_core is imported where it is used (tool schemas, LangChain messages, partial-JSON repair): the
# tags and plain_messages serve the trace replay and the benchmarks on machines without LangChain

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
PROTOCOL_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
"""The tags the protocol writes around calls and results: message text holding one is broken before
rendering (:meth:`~patchkv_agent.core.encoding.SegmentEncoder.as_text`), so a tool result cannot close its
``<tool_response>`` wrapper early or forge a call."""
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_SCALARS = (str, int, float, bool, type(None))
_TAGGED = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*(?:```|$)", re.S)
_NAME = re.compile(r"""["']name["']\s*:\s*["']([^"']+)["']""")
_ARG_KEYS = ("arguments", "args", "parameters", "tool_input")

PROTOCOL_HEADER = "You can call tools. Available tools (JSON schemas):"
PROTOCOL_FOOTER = (
    "To call a tool, reply with only this line:\n"
    + TOOL_CALL_OPEN + '{"name": "<tool name>", "arguments": {<arguments>}}' + TOOL_CALL_CLOSE
    + "\nOtherwise reply with your answer."
)


@dataclass(frozen=True)
class ParsedOutput:
    """Model output split into text and tool calls (LangChain ``ToolCall`` / ``InvalidToolCall`` dicts)."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)


def new_call_id() -> str:
    """A fresh tool-call id."""
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- protocol

def tool_schemas(tools: Iterable[Any]) -> list[dict[str, Any]]:
    """OpenAI-format tool schemas of LangChain tools, functions, pydantic classes or dicts, checked.

    Args:
        tools: a list (any iterable but a string or a dict) of tools.

    Returns:
        One ``{"type": "function", "function": {"name", "description", "parameters"}}`` dict per tool.

    Raises:
        TypeError: ``tools`` is a string, a dict or not iterable; a tool that is not a tool, function,
            pydantic class or dict; a schema whose fields have the wrong types (e.g. ``parameters`` given
            as a list or a string) or that is not JSON-serializable. The message names the tool and field.
        ValueError: a tool with an empty name, or a tool LangChain cannot convert.
    """
    from langchain_core.utils.function_calling import convert_to_openai_tool

    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Iterable):
        raise TypeError(f"tools must be a list of tools (LangChain tools, functions, pydantic classes or "
                        f"OpenAI-format dicts), got {type(tools).__name__}; wrap a single tool in a list")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        if t is None or isinstance(t, (str, bytes, int, float, list, tuple, set, frozenset)):
            raise TypeError(f"tools[{i}] must be a LangChain tool, a function, a pydantic class or an OpenAI-format "
                            f"dict, got {type(t).__name__} {_short(t)}")
        try:
            schema = convert_to_openai_tool(t)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            raise ValueError(f"tools[{i}]: cannot read a tool schema from {type(t).__name__} {_short(t)}: {first}") from None
        out.append(check_tool_schema(schema, f"tools[{i}]"))
    return out


def _short(x: Any, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def check_tool_schema(schema: Any, where: str = "tool") -> dict[str, Any]:
    """Check one OpenAI-format tool schema's structure (what the grammar and the prompt read).

    Args:
        schema: ``{"type": "function", "function": {...}}`` (or the bare function dict).
        where: how to name it in errors (e.g. ``"tools[2]"``).

    Returns:
        The schema in the ``{"type": "function", "function": {...}}`` form.

    Raises:
        TypeError: a field of the wrong type (``function``, ``name``, ``description``, ``parameters``,
            ``properties``, ``required``) or a schema that is not JSON-serializable.
        ValueError: an empty name.
    """
    if not isinstance(schema, dict):
        raise TypeError(f"{where}: a tool schema must be a dict, got {type(schema).__name__} {_short(schema)}")
    fn = schema.get("function", schema) if schema.get("type", "function") == "function" else schema
    if not isinstance(fn, dict):
        raise TypeError(f"{where}: 'function' must be a dict like {{'name': ..., 'parameters': {{...}}}}, got "
                        f"{type(fn).__name__} {_short(fn)}")
    name = fn.get("name")
    if not isinstance(name, str):
        raise TypeError(f"{where}: the tool name must be a string, got {type(name).__name__} {_short(name)}")
    if not name.strip():
        raise ValueError(f"{where}: the tool name is empty")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise TypeError(f"{where} ({name}): 'description' must be a string, got {type(desc).__name__}")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise TypeError(f"{where} ({name}): 'parameters' must be a JSON schema dict (e.g. {{'type': 'object', "
                            f"'properties': {{...}}}}), got {type(params).__name__} {_short(params)}")
        props = params.get("properties")
        if props is not None and not (isinstance(props, dict) and all(isinstance(v, (dict, bool)) for v in props.values())):
            raise TypeError(f"{where} ({name}): 'parameters.properties' must map argument names to JSON schemas, got "
                            f"{_short(props)}")
        req = params.get("required")
        if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
            raise TypeError(f"{where} ({name}): 'parameters.required' must be a list of argument names, got "
                            f"{_short(req)}")
    try:
        json.dumps(fn)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where} ({name}): the schema is not JSON-serializable ({e})") from None
    return {"type": "function", "function": fn}


def tool_protocol_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The protocol text for ``tools`` (OpenAI-format schemas): one compact JSON schema a line."""
    lines = [PROTOCOL_HEADER]
    for t in tools:
        fn = t.get("function", t)
        lines.append(json.dumps({"name": fn.get("name"), "description": fn.get("description", ""),
                                 "parameters": fn.get("parameters", {})}, separators=(",", ":")))
    lines.append(PROTOCOL_FOOTER)
    return "\n".join(lines)


def with_tool_protocol(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trace-format messages with the protocol appended to the system message (one is added if none).

    Args:
        messages: trace-format message dicts (``docs/TRACES.md``).
        tools: OpenAI-format tool schemas (nothing changes when empty).

    Returns:
        A new list; the input is not modified.
    """
    if not tools:
        return list(messages)
    proto = tool_protocol_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = ((out[0].get("content") or "") + "\n\n" + proto).strip()
    else:
        out.insert(0, {"role": "system", "content": proto})
    return out


def plain_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Trace messages a plain chat template can render: tool calls and results written out as text.

    An assistant message's ``tool_calls`` become one ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
    line each after its content; a ``tool`` message's content is wrapped in ``<tool_response>`` tags.

    Args:
        messages: message dicts of the trace format (``role``, ``content``, optional ``tool_calls``).

    Returns:
        ``{"role", "content"}`` dicts, one per input message (a missing role reads as ``user``).
    """
    out = []
    for m in messages:
        role, content = m.get("role", "user"), m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(
                TOOL_CALL_OPEN + json.dumps({"name": c.get("name"), "arguments": c.get("args", {})}) + TOOL_CALL_CLOSE
                for c in m["tool_calls"])
            content = (content + "\n" + calls).strip()
        if role == "tool":
            content = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
        out.append({"role": role, "content": content})
    return out


_CALL_BLOCKS = ("tool_use", "tool_call", "function_call", "tool_call_chunk")


def check_text(value: str, where: str) -> str:
    """``value``, checked to be text a tokenizer can encode (no surrogate code points).

    Args:
        value: a string.
        where: how to name it in errors (e.g. ``"messages[3].content"``).
    Returns:
        ``value``.
    Raises:
        ValueError: ``value`` holds a lone surrogate (U+D800-U+DFFF): the message names the field, the code
            point, its index and the fix.
    """
    m = _SURROGATE.search(value)
    if m is not None:
        i = m.start()
        raise ValueError(
            f"{where} holds a lone surrogate U+{ord(m.group()):04X} at index {i}: {value[max(0, i - 24):i + 24]!r}; "
            "that is not Unicode text and no tokenizer encodes it: replace it (text.encode('utf-8', 'replace')"
            ".decode('utf-8')) or decode the source bytes with errors='replace' rather than 'surrogateescape'")
    return value


def check_json_text(value: Any, where: str) -> Any:
    """``value``, checked to be JSON data (str, number, bool, None, lists and dicts of them) whose strings
    are text a tokenizer can encode: tool-call arguments and tool schemas, before they are rendered.

    Args:
        value: the data.
        where: how to name it in errors (e.g. ``"messages[2].tool_calls[0].args"``).
    Returns:
        ``value``.
    Raises:
        ValueError: bytes or another non-JSON value, or a string with a lone surrogate; the message names
            the field (e.g. ``messages[2].tool_calls[0].args['data']``) and the fix.
    """
    if isinstance(value, str):
        return check_text(value, where)
    if isinstance(value, _JSON_SCALARS):
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, _JSON_SCALARS):
                raise ValueError(f"{where} has a key of type {type(k).__name__} ({_short(k)}); JSON keys are strings")
            if isinstance(k, str):
                check_text(k, f"{where} key {_short(k)}")
            check_json_text(v, f"{where}[{_short(k, 40)}]")
        return value
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_json_text(v, f"{where}[{i}]")
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{where} is {type(value).__name__} ({_short(bytes(value))}), which JSON cannot hold: pass "
                         "a str (value.decode('utf-8'), or base64 for binary data)")
    raise ValueError(f"{where} must be JSON data (str, number, bool, None, list or dict), got {type(value).__name__} "
                     f"{_short(value)}: convert it to one of those first")


def _text(content: Any, where: str = "message", calls_ok: bool = False, field: str | None = None) -> str:
    """The text of a message's content: a string, or ``str`` / ``{"type": "text"}`` blocks, joined.

    Raises:
        ValueError: any other block (image, audio, file ...), naming what is supported; a text part that is
            not a string, or text with a lone surrogate (naming ``field``, e.g. ``messages[3].content``).
    """
    field = field or f"{where}.content"
    if isinstance(content, str):
        return check_text(content, field)
    parts = []
    for j, block in enumerate(content or []):
        if isinstance(block, str):
            parts.append(check_text(block, f"{field}[{j}]"))
        elif isinstance(block, dict) and block.get("type") == "text":
            text = block.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"{field}[{j}].text must be a str, got {type(text).__name__} {_short(text)}: pass "
                                 "the text as a string ({'type': 'text', 'text': str(value)})")
            parts.append(check_text(text, f"{field}[{j}].text"))
        elif isinstance(block, dict) and calls_ok and block.get("type") in _CALL_BLOCKS:
            continue  # the same call is in AIMessage.tool_calls
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"PatchKVChatModel reads text only: a {where} has a {kind!r} content block; supported "
                             "content is a string or a list of strings and {'type': 'text', 'text': ...} blocks "
                             "(tool calls go in AIMessage.tool_calls). Describe images/files/audio in text.")
    return "".join(parts)


def _call(c: dict, where: str) -> dict[str, Any]:
    """One tool call of an AIMessage in the trace format, its name, id and arguments checked."""
    name, cid, args = c.get("name"), c.get("id"), c.get("args", {})
    if not isinstance(name, str):
        raise ValueError(f"{where}.name must be a str, got {type(name).__name__} {_short(name)}")
    check_text(name, f"{where}.name")
    if cid is not None:
        if not isinstance(cid, str):
            raise ValueError(f"{where}.id must be a str or None, got {type(cid).__name__} {_short(cid)}")
        check_text(cid, f"{where}.id")
    return {"id": cid, "name": name, "args": check_json_text(args, f"{where}.args")}


def to_trace_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as trace-format message dicts (``docs/TRACES.md``).

    Returns:
        ``{"role", "content"}`` dicts; assistant tool calls as ``tool_calls: [{"id", "name", "args"}]``,
        tool results with ``tool_call_id``.

    Raises:
        TypeError: a message that is not a LangChain message.
        ValueError: non-text content (images, audio, files ...); a text part that is not a string; a lone
            surrogate in a message's text, role, tool call or tool-call id; tool-call arguments that are not
            JSON data (bytes ...). The message names the field (``messages[3].content[0].text``).
    """
    from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        at, kind = f"messages[{i}]", type(m).__name__
        field = f"{at}.content"
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": _text(m.content, kind, field=field)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": _text(m.content, kind, field=field)})
        elif isinstance(m, AIMessage):
            d: dict[str, Any] = {"role": "assistant", "content": _text(m.content, kind, calls_ok=True, field=field)}
            if m.tool_calls:
                d["tool_calls"] = [_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]
            out.append(d)
        elif isinstance(m, ToolMessage):
            out.append({"role": "tool", "tool_call_id": check_text(m.tool_call_id, f"{at}.tool_call_id"),
                        "content": _text(m.content, kind, field=field)})
        elif isinstance(m, ChatMessage):
            out.append({"role": check_text(m.role, f"{at}.role"), "content": _text(m.content, kind, field=field)})
        elif isinstance(m, BaseMessage):
            out.append({"role": m.type, "content": _text(m.content, kind, field=field)})
        else:
            raise TypeError(f"expected LangChain messages, got {type(m).__name__}")
    return out


# --------------------------------------------------------------------------- parser

def parse_partial_json(blob: str) -> Any:
    """``langchain_core.utils.json.parse_partial_json`` (imported on first use)."""
    from langchain_core.utils.json import parse_partial_json as parse

    return parse(blob)


def _loads(blob: str, repair: bool = True) -> Any:
    """JSON, else (``repair``) repaired partial JSON, else a Python literal; ValueError when none reads it."""
    blob = blob.strip()
    fence = _FENCE.fullmatch(blob)
    if fence:
        blob = fence.group(1)
    try:
        return json.loads(blob)
    except ValueError:
        pass
    if repair:
        try:
            val = parse_partial_json(blob)
            if val is not None:
                return val
        except Exception:
            pass
    try:
        return ast.literal_eval(blob)
    except Exception:
        raise ValueError("not JSON") from None


def _call_from(obj: Any) -> tuple[str | None, dict | None, str | None]:
    """(name, args, error) of one decoded call object."""
    if not isinstance(obj, dict):
        return None, None, f"a tool call must be a JSON object, got {type(obj).__name__}"
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    name = fn.get("name", obj.get("tool"))
    args: Any = {}
    for k in _ARG_KEYS:
        if k in fn:
            args = fn[k]
            break
    if isinstance(args, str):
        try:
            args = _loads(args) if args.strip() else {}
        except ValueError:
            return name if isinstance(name, str) else None, None, "arguments are not JSON"
    if not isinstance(name, str) or not name:
        return None, None, "tool call without a name"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return name, None, f"arguments must be an object, got {type(args).__name__}"
    return name, args, None


def _decode(blob: str, calls: list, invalid: list, cut: str | None = None, raw: str | None = None) -> None:
    """Read one call blob into ``calls`` / ``invalid``. A blob that needs repairing (truncated JSON) is
    never a call: it is an invalid call, with ``cut`` as the error when the output was cut off. ``raw``
    (the call's whole text, tags included) is an invalid single call's ``args``: text no JSON reader
    turns back into a call (a streamed message's chunks are re-parsed with partial-JSON repair)."""
    try:
        obj = _loads(blob, repair=False)
    except ValueError:
        m = _NAME.search(blob)
        invalid.append({"name": m.group(1) if m else None, "args": raw or blob.strip(), "id": new_call_id(),
                        "error": cut or "tool call is not valid JSON", "type": "invalid_tool_call"})
        return
    for o in obj if isinstance(obj, list) else [obj]:
        name, args, err = _call_from(o)
        if err is None:
            calls.append({"name": name, "args": args, "id": new_call_id(), "type": "tool_call"})
        else:
            text = raw if (raw and not isinstance(obj, list)) else (json.dumps(o) if not isinstance(o, str) else o)
            invalid.append({"name": name, "args": text, "id": new_call_id(), "error": err,
                            "type": "invalid_tool_call"})


def _bare_calls(text: str, tool_names: set[str] | None) -> list[tuple[int, int, Any]]:
    """Spans ``(start, end, obj)`` of bare JSON objects that look like calls (known names only, when given);
    ``obj`` is None for an unterminated last one."""
    dec = json.JSONDecoder()
    spans, i = [], 0
    while (i := text.find("{", i)) >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            tail = text[i:]
            if not _NAME.search(tail[:200]):
                i += 1
                continue
            try:
                partial = parse_partial_json(tail)
            except Exception:
                partial = None
            name, _, _ = _call_from(partial)
            if partial is None or name is None or (tool_names is not None and name not in tool_names):
                i += 1
                continue
            spans.append((i, len(text), None))  # unterminated: an invalid call, never repaired
            break
        name, _, _ = _call_from(obj)
        looks = isinstance(obj, dict) and name is not None and (
            any(k in obj for k in _ARG_KEYS) or "function" in obj or (tool_names is not None and name in tool_names))
        if looks and (tool_names is None or name in tool_names):
            spans.append((i, end, obj))
            i = end
        else:
            i += 1
    return spans


def parse_tool_calls(text: str, tool_names: Iterable[str] | None = None, *, bare: bool = True,
                     truncated: bool = False) -> ParsedOutput:
    """Split model output into content and tool calls, tolerating malformed and absent calls.

    Tagged calls (``<tool_call>...</tool_call>``) are read whatever their name; without tags (and with
    ``bare``), bare JSON objects count as calls only when they carry a name (and, when ``tool_names`` is
    given, a known one). Truncated JSON is never repaired into a call: it becomes an invalid call.

    Args:
        text: the decoded model output.
        tool_names: names of the bound tools (None: any name).
        bare: also read untagged JSON calls (off under a grammar, which only admits tagged calls).
        truncated: the output was cut off by the token limit: an unterminated last tagged call, or an
            opening tag cut off at the end (``<tool_c``), is an invalid call saying so, even if its JSON
            happens to parse.

    Returns:
        A :class:`ParsedOutput`: ``content`` is the text without the call spans (stripped); calls carry
        fresh ids; unreadable calls are ``invalid_tool_calls`` with the raw text as ``args`` (a tagged
        call's whole text, tags included, so that no partial-JSON reader repairs it into a call).
    """
    names = set(tool_names) if tool_names is not None else None
    calls: list[dict] = []
    invalid: list[dict] = []
    cut_msg = "tool call cut off by the token limit (raise max_tokens)"
    tagged = list(_TAGGED.finditer(text))
    partial = _partial_open(text) if truncated and not tagged else 0
    if partial:  # cut off inside the opening tag (``<tool_ca``): a call was starting
        invalid.append({"name": None, "args": text[len(text) - partial:], "id": new_call_id(), "error": cut_msg,
                        "type": "invalid_tool_call"})
        text = text[:len(text) - partial]
    if tagged:
        for m in tagged:
            unterminated = not m.group(0).endswith(TOOL_CALL_CLOSE)
            if unterminated and truncated:
                nm = _NAME.search(m.group(1))
                invalid.append({"name": nm.group(1) if nm else None, "args": m.group(0).strip(), "id": new_call_id(),
                                "error": cut_msg, "type": "invalid_tool_call"})
                continue
            _decode(m.group(1), calls, invalid, None, raw=m.group(0).strip())
        content = _TAGGED.sub("", text)
    elif bare:
        spans = _bare_calls(text, names)
        pieces, last = [], 0
        for start, end, obj in spans:
            pieces.append(text[last:start])
            if obj is None:  # an unterminated bare call
                nm = _NAME.search(text[start:end])
                invalid.append({"name": nm.group(1) if nm else None, "args": text[start:end].strip(),
                                "id": new_call_id(), "error": cut_msg if truncated else "tool call is not valid JSON",
                                "type": "invalid_tool_call"})
            else:
                _decode(json.dumps(obj), calls, invalid)
            last = end
        pieces.append(text[last:])
        content = "".join(pieces)
        if spans:
            content = re.sub(r"```(?:json)?\s*```", "", content)
    else:
        content = text
    return ParsedOutput(content=content.strip(), tool_calls=calls, invalid_tool_calls=invalid)


def _partial_open(text: str) -> int:
    """Length of a trailing proper prefix of ``<tool_call>`` (at least ``<t``) at the end of ``text``, else 0."""
    for k in range(len(TOOL_CALL_OPEN) - 1, 1, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0


def held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the prefix of ``text`` that can be shown while streaming: up to the first marker, and
    not into a trailing partial marker (``"<tool_"`` at the end may become ``"<tool_call>"``)."""
    safe = len(text)
    for mk in markers:
        if not mk:
            continue
        idx = text.find(mk)
        if idx >= 0:
            safe = min(safe, idx)
            continue
        for k in range(min(len(mk) - 1, len(text)), 0, -1):
            if text.endswith(mk[:k]):
                safe = min(safe, len(text) - k)
                break
    return safe

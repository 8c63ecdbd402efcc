"""Grammar-constrained decoding for tool calls and structured output, with xgrammar.

xgrammar (the structured-generation engine of vLLM and SGLang) compiles a grammar against the model's
tokenizer once and, at each decode step, fills a bitmask of the tokens that keep the output inside the
grammar; :class:`GrammarProcessor` applies it to the step's logits (a
:class:`~patchkv_agent.core.sampling.LogitsProcessor`), so the choice runs in the same resume/decode path
as every other token (KV reuse is unchanged; only the token choice is masked). Picked over llguidance by
``scripts/grammar_backends.py`` on SmolLM2's tokenizer (one CPU thread: 0.25 ms per token against 0.30, tokenizer
set-up 0.29 s against 0.66 s), and for its structural tags, which give ``tool_choice="auto"`` directly.

Formats (the tool-call text is the JSON protocol of :mod:`~patchkv_agent.langgraph.tools`):

- ``forced_call(tools)``: exactly one ``<tool_call>{"name": "<one of tools>", "arguments": {...}}</tool_call>``
  whose arguments match that tool's JSON schema (``tool_choice="any"`` or a tool's name);
- ``auto_calls(tools)``: free text; once the model writes ``<tool_call>``, a schema-valid call of a bound
  tool must follow (``tool_choice="auto"``/None), so the model chooses between text and a valid call;
- ``json_schema(schema)``: a JSON value matching ``schema``; ``json_object()``: any JSON object.

Knows xgrammar, the tool-call text protocol and tokenizers; nothing about the engine or LangChain.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import torch

from .tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

MAX_WHITESPACE = 2  # consecutive whitespace inside constrained JSON (keeps weak models from padding forever)


def _call_begin(name: str) -> str:
    return TOOL_CALL_OPEN + '{"name": ' + json.dumps(name) + ', "arguments": '


def _params(tool: dict) -> dict:
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return params if params.get("type") == "object" or "properties" in params else {"type": "object", **params}


class GrammarProcessor:
    """One decode's grammar state: masks each step's logits, advances with the chosen token.

    Args:
        compiled: an ``xgrammar.CompiledGrammar``.
        vocab_size: the model's logits width.

    Attributes:
        mask_s: seconds spent filling and applying masks (for overhead measurements).
    """

    def __init__(self, compiled: Any, vocab_size: int, banned: torch.Tensor | None = None):
        import xgrammar as xgr

        self._xgr = xgr
        self.banned = banned
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.mask_s = 0.0
        self.steps = 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.reshape(1, -1)
        if row.device.type != "cpu":
            self._xgr.apply_token_bitmask_inplace(row, self.bitmask.to(row.device, non_blocking=True))
        else:
            self._xgr.apply_token_bitmask_inplace(row, self.bitmask)
        if self.banned is not None and self.banned.numel():
            logits[self.banned.to(logits.device)] = float("-inf")
        self.mask_s += time.perf_counter() - t0
        self.steps += 1
        return logits

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"bug: grammar rejected token {token} that its own mask allowed")

    @property
    def done(self) -> bool:
        return self.matcher.is_terminated()


class GrammarCompiler:
    """Compiles (and caches) grammars for one tokenizer.

    Args:
        tokenizer: the Hugging Face tokenizer the model decodes with.
        vocab_size: the model's logits width (may exceed ``len(tokenizer)``).
        stop_ids: token ids that end the output (EOS); allowed once a grammar is complete.

    Other special tokens (pad, unk, chat-template markers) are never allowed under a grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=sorted(int(i) for i in stop_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info)
        stops = {int(i) for i in stop_ids}
        self.banned = torch.tensor(sorted(i for i in getattr(tokenizer, "all_special_ids", []) or []
                                          if i not in stops and 0 <= i < self.vocab_size), dtype=torch.long)
        self._cache: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _compiled(self, key: str, build) -> Any:
        with self._lock:
            if key not in self._cache:
                self._cache[key] = build()
            return self._cache[key]

    def processor(self, spec: dict[str, Any]) -> GrammarProcessor:
        """A fresh :class:`GrammarProcessor` for ``spec`` (``{"kind": ..., ...}``, see :func:`spec_for`).

        Raises:
            ValueError: an unknown kind, or a schema xgrammar cannot compile.
        """
        key = json.dumps(spec, sort_keys=True, default=str)
        try:
            compiled = self._compiled(key, lambda: self._compile(spec))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"cannot build a grammar for {spec.get('kind')}: {e}") from e
        return GrammarProcessor(compiled, self.vocab_size, self.banned)

    def _compile(self, spec: dict[str, Any]) -> Any:
        from xgrammar.structural_tag import (
            JSONSchemaFormat,
            OrFormat,
            StructuralTag,
            TagFormat,
            TriggeredTagsFormat,
        )

        kind = spec["kind"]
        if kind in ("forced_call", "auto_calls"):
            tags = [TagFormat(begin=_call_begin(t["function"]["name"]),
                              content=JSONSchemaFormat(json_schema=_params(t), max_whitespace_cnt=MAX_WHITESPACE),
                              end="}" + TOOL_CALL_CLOSE) for t in spec["tools"]]
            if kind == "forced_call":
                fmt = tags[0] if len(tags) == 1 else OrFormat(elements=tags)
            else:
                fmt = TriggeredTagsFormat(triggers=[TOOL_CALL_OPEN], tags=tags)
            return self.compiler.compile_structural_tag(StructuralTag(format=fmt))
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
        raise ValueError(f"unknown grammar kind {kind!r}")


class GrammarCompilers:
    """The :class:`GrammarCompiler` of each owner (an engine: its tokenizer), compiled once and shared by every
    chat model over that owner.

    Process-wide by nature: LangChain copies and wraps a chat model freely (``bind_tools``,
    ``with_structured_output``, ``with_config``, pydantic copies) and many build one per request, so a compiler
    held by one chat model would compile the tokenizer's vocabulary again for each; what they share is the
    engine. Entries are keyed weakly by the owner (an entry goes with it; the compiler holds no reference to
    it). Lookups are serialised by the table's lock, so two first calls compile once.
    """

    def __init__(self) -> None:
        self._by_owner: "weakref.WeakKeyDictionary[Any, GrammarCompiler]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def compiler_for(self, owner: Any, build: Callable[[], GrammarCompiler]) -> GrammarCompiler:
        """The compiler of ``owner``, built with ``build()`` the first time.

        Args:
            owner: what the compiler belongs to (weakly referenced: an engine).
            build: makes the compiler (called under the table's lock, once per owner).

        Returns:
            The owner's compiler.
        """
        with self._lock:
            gc = self._by_owner.get(owner)
            if gc is None:
                gc = self._by_owner[owner] = build()
            return gc


GRAMMARS = GrammarCompilers()  # the process's table (see GrammarCompilers)


def spec_for(*, tools: Sequence[dict] | None = None, tool_choice: Any = None,
             response_format: dict | None = None) -> dict[str, Any] | None:
    """The grammar of one call.

    Args:
        tools: OpenAI-format tool schemas bound to the call.
        tool_choice: None / ``"auto"`` (text or a valid call), ``"any"`` / ``"required"`` / True (a valid
            call of any bound tool), a tool name or ``{"type": "function", "function": {"name": ...}}``
            (a valid call of that tool), ``"none"`` (no tools; no grammar).
        response_format: ``{"type": "json_schema", "json_schema": {"schema": ...}}`` or
            ``{"type": "json_object"}`` (structured output).

    Returns:
        A spec for :meth:`GrammarCompiler.processor`, or None for unconstrained text.

    Raises:
        ValueError: an unknown ``tool_choice`` or tool name, a forced call without tools, or a
            ``response_format`` of unknown type.
        TypeError: a ``tool_choice`` of the wrong type (e.g. ``{"function": 3}``), or tools that are not a
            list of well-formed schemas (see :func:`~patchkv_agent.langgraph.tools.check_tool_schema`).
    """
    if response_format is not None:
        rtype = response_format.get("type") if isinstance(response_format, dict) else None
        if rtype == "json_schema":
            js = response_format.get("json_schema") or {}
            schema = js.get("schema", js) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
            return {"kind": "json_schema", "schema": schema}
        if rtype == "json_object":
            return {"kind": "json_object"}
        raise ValueError(f"response_format type must be 'json_schema' or 'json_object', got {response_format!r}")
    from .tools import check_tool_schema

    if tools is not None and (isinstance(tools, (str, bytes, dict)) or not hasattr(tools, "__iter__")):
        raise TypeError(f"tools must be a list of OpenAI-format tool schemas, got {type(tools).__name__}")
    tools = [check_tool_schema(t, f"tools[{i}]") for i, t in enumerate(tools or [])]
    if isinstance(tool_choice, str) and tool_choice == "none":
        return None
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, dict):
        tool_choice = _tool_choice_name(tool_choice)
    elif tool_choice is not None and not isinstance(tool_choice, (str, bool)):
        raise TypeError(f"tool_choice must be 'auto', 'any', 'required', 'none', a tool name, True or "
                        f"{{'type': 'function', 'function': {{'name': ...}}}}; got {type(tool_choice).__name__} "
                        f"{tool_choice!r:.60}")
    if tool_choice in (None, "auto"):
        return {"kind": "auto_calls", "tools": tools} if tools else None
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs bound tools (bind_tools([...], tool_choice=...))")
    if tool_choice in ("any", "required", True):
        return {"kind": "forced_call", "tools": tools}
    if isinstance(tool_choice, str):
        if tool_choice not in names:
            raise ValueError(f"tool_choice {tool_choice!r} is not a bound tool; bound: {names}")
        return {"kind": "forced_call", "tools": [tools[names.index(tool_choice)]]}
    raise ValueError(f"tool_choice must be 'auto', 'any', 'required', 'none', a tool name or a function dict; "
                     f"got {tool_choice!r:.60}")


def _tool_choice_name(choice: dict) -> str:
    """The tool name of a dict ``tool_choice`` (``{"type": "function", "function": {"name": ...}}`` or
    ``{"name": ...}``).

    Raises:
        TypeError: ``function`` that is not a dict, or a name that is not a string.
        ValueError: a dict that names no function.
    """
    form = "{'type': 'function', 'function': {'name': 'my_tool'}}"
    fn = choice.get("function")
    if fn is not None and not isinstance(fn, dict):
        raise TypeError(f"tool_choice['function'] must be a dict like {{'name': 'my_tool'}}, got {type(fn).__name__} "
                        f"{fn!r:.60}; pass {form}")
    if "type" in choice and choice["type"] != "function":
        raise ValueError(f"tool_choice['type'] must be 'function', got {choice['type']!r:.60}; pass {form}")
    name = (fn or {}).get("name", choice.get("name"))
    if name is None:
        raise ValueError(f"tool_choice dict must name a function: {form}")
    if not isinstance(name, str):
        raise TypeError(f"tool_choice's function name must be a string, got {type(name).__name__} {name!r:.60}; "
                        f"pass {form}")
    return name

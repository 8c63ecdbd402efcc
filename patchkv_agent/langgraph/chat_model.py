"""``PatchKVChatModel``: a LangChain chat model over a local Hugging Face model with per-thread KV reuse.

Each call renders the messages with the tokenizer's chat template, finds its thread key (the one set by
:class:`~patchkv_agent.langgraph.middleware.PatchKVMiddleware` or :func:`~patchkv_agent.langgraph.node.patchkv_node`,
else ``configurable.thread_id`` + namespace of the run config, else ``default_thread_id``) and resumes
that thread's previous context version through a :class:`~patchkv_agent.runtime.threads.ThreadRegistry`
(diff, plan, restore, recompute), then decodes greedily token by token. The resume stats of each call
are in ``AIMessage.response_metadata["patchkv"]``.

Tools (``bind_tools``): rendered with ``tools=`` by chat templates that use it; otherwise (SmolLM2's
template ignores it) the JSON protocol of :mod:`~patchkv_agent.langgraph.tools` is appended to the
system prompt, and earlier calls/results are written back as text (:func:`~patchkv_agent.langgraph.tools.plain_messages`).
Output is parsed by the tolerant :func:`~patchkv_agent.langgraph.tools.parse_tool_calls`. ``tool_choice``
is not enforced (a local greedy decoder cannot be forced to call); ``"none"`` hides the tools.

Streaming yields one chunk per decoded token whose text is final: while tools are bound, text from a
possible call start (``<tool_call>`` or ``{``) on is held back and the last chunk carries the rest and
the parsed calls, so the concatenated stream equals the non-streamed message. Async methods run the
sync path in an executor.

Knows LangChain's chat-model interface, the registry and the engine's public methods; nothing about graphs.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Iterator, Literal, Sequence

import numpy as np
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.callbacks.manager import handle_event
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables.config import ensure_config, run_in_executor
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from ..runtime.threads import ThreadKey, ThreadRegistry
from .keys import current_thread_key, thread_key_from_config, thread_key_from_metadata
from .tools import (TOOL_CALL_OPEN, ParsedOutput, held_back, parse_tool_calls, plain_messages, to_trace_messages,
                    tool_schemas, with_tool_protocol)

log = logging.getLogger(__name__)
_KEY_KWARG = "patchkv_thread_key"
CONTEXT_EVENT = "patchkv_context"  # custom callback event: the rendered context of a call (for recorders)
_PROBE_TOOL = {"type": "function", "function": {"name": "patchkv_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x


class PatchKVChatModel(BaseChatModel):
    """Chat model over a :class:`~patchkv_agent.engine.PatchKVEngine` that reuses KV per agent thread.

    Build it with ``PatchKVChatModel(registry=ThreadRegistry(engine))`` (share the registry with the
    middleware / node wrapper / checkpointer) or ``PatchKVChatModel(engine=engine)`` (a registry of its own).

    Attributes:
        registry: the :class:`~patchkv_agent.runtime.threads.ThreadRegistry` holding the threads' KV.
        strategy: resume strategy when a thread has KV (``patchkv``, ``prefix``, ``direct``, ``exact`` ...).
        strategy_options: options for the strategy (``dirty_window=``, ``kappa=`` ...).
        max_new_tokens: greedy tokens per call (also a per-call kwarg).
        default_thread_id: thread for calls that name none (None, the default: such calls are exact and
            keep no state, so unrelated conversations never share KV).
        tool_protocol: ``auto`` (template when it renders ``tools=``, else JSON), ``template`` or ``json``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    registry: Any = Field(exclude=True)
    strategy: str = "patchkv"
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    max_new_tokens: int = 128
    default_thread_id: str | None = None
    tool_protocol: Literal["auto", "template", "json"] = "auto"
    model_name: str = "patchkv-local"
    _template_tools: bool | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _registry_from_engine(cls, data: Any) -> Any:
        if isinstance(data, dict) and "engine" in data:
            data = dict(data)
            engine = data.pop("engine")
            if data.get("registry") is None:
                data["registry"] = ThreadRegistry(engine)
            elif data["registry"].engine is not engine:
                raise ValueError("PatchKVChatModel: pass either engine= or registry=, not both with different engines")
        if isinstance(data, dict) and not isinstance(data.get("registry"), ThreadRegistry):
            raise ValueError("PatchKVChatModel needs registry=ThreadRegistry(engine) or engine=PatchKVEngine(...)")
        return data

    @property
    def engine(self):
        """The :class:`~patchkv_agent.engine.PatchKVEngine` behind the registry."""
        return self.registry.engine

    @property
    def _llm_type(self) -> str:
        return "patchkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "strategy": self.strategy, "max_new_tokens": self.max_new_tokens,
                "fingerprint": self.engine.spec.fingerprint[:16]}

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | None = None, **kwargs: Any):
        """Bind tools (LangChain tools, functions, pydantic classes or OpenAI-format dicts).

        Returns:
            A runnable that passes the tools' OpenAI-format schemas to every call.
        """
        return self.bind(tools=tool_schemas(tools), tool_choice=tool_choice, **kwargs)

    # ------------------------------------------------------------- rendering

    def template_renders_tools(self) -> bool:
        """Whether the tokenizer's chat template renders ``tools=`` (probed once)."""
        if self._template_tools is None:
            tok, msgs = self.engine.tokenizer, [{"role": "user", "content": "hi"}]
            try:
                plain = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                with_tools = tok.apply_chat_template(msgs, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
                self._template_tools = plain != with_tools and "patchkv_probe_tool" in with_tools
            except Exception:
                self._template_tools = False
        return self._template_tools

    def render(self, messages: Sequence[BaseMessage], tools: Sequence[dict] | None = None) -> tuple[list[dict], list[int], str]:
        """The context one call sees.

        Args:
            messages: the conversation.
            tools: OpenAI-format tool schemas (bound tools).

        Returns:
            ``(trace_messages, token_ids, mode)``: trace-format messages (docs/TRACES.md) as the model saw
            them (JSON protocol included), their ids, and ``mode`` one of ``plain``, ``json``, ``template``. For ``plain`` and
            ``json``, ``patchkv-agent replay`` renders ``trace_messages`` to the same ids.

        Raises:
            ValueError: the engine has no tokenizer.
        """
        if self.engine.tokenizer is None:
            raise ValueError("PatchKVChatModel needs an engine with a tokenizer (it renders chat templates)")
        trace = to_trace_messages(messages)
        if not tools:
            return trace, self.engine.encode(plain_messages(trace)), "plain"
        use_template = self.tool_protocol == "template" or (self.tool_protocol == "auto" and self.template_renders_tools())
        if use_template:
            try:
                tok = self.engine.tokenizer
                text = tok.apply_chat_template(_native(trace), tools=list(tools), tokenize=False,
                                               add_generation_prompt=True)
                return trace, list(tok(text, add_special_tokens=False)["input_ids"]), "template"
            except Exception as e:  # a template that takes tools= but not tool-call messages
                log.warning("chat template failed on tool messages (%s); using the JSON tool protocol", e)
        trace = with_tool_protocol(trace, tools)
        return trace, self.engine.encode(plain_messages(trace)), "json"

    def _decode_text(self, output_ids: list[int]) -> str:
        """Text of the output so far (subclasses may override, e.g. to script replies in tests)."""
        return self.engine.tokenizer.decode(output_ids, skip_special_tokens=True)

    def _thread_key(self, run_manager, explicit: ThreadKey | None) -> ThreadKey | None:
        """Key precedence: middleware / node wrapper, the config passed to this call, the graph run's
        config, the run's callback metadata, ``default_thread_id``."""
        key = current_thread_key()
        if key is not None:
            return key
        if explicit is not None:
            return explicit
        conf = ensure_config()
        if (conf.get("configurable") or {}).get("thread_id") is not None:
            return thread_key_from_config(conf)
        meta = getattr(run_manager, "metadata", None) or {}
        return thread_key_from_metadata(meta, default_thread_id=self.default_thread_id)

    @staticmethod
    def _with_call_key(config, kwargs: dict) -> dict:
        # A config passed to invoke/stream is not visible inside _generate (langchain-core passes only its
        # callbacks, tags and metadata on): carry its thread key as a call kwarg.
        if isinstance(config, dict) and (config.get("configurable") or {}).get("thread_id") is not None:
            kwargs.setdefault(_KEY_KWARG, tuple(thread_key_from_config(config)))
        return kwargs

    def invoke(self, input, config=None, *, stop=None, **kwargs):  # noqa: D102 - BaseChatModel.invoke
        return super().invoke(input, config, stop=stop, **self._with_call_key(config, kwargs))

    async def ainvoke(self, input, config=None, *, stop=None, **kwargs):  # noqa: D102
        return await super().ainvoke(input, config, stop=stop, **self._with_call_key(config, kwargs))

    def stream(self, input, config=None, *, stop=None, **kwargs):  # noqa: D102
        yield from super().stream(input, config, stop=stop, **self._with_call_key(config, kwargs))

    async def astream(self, input, config=None, *, stop=None, **kwargs):  # noqa: D102
        async for chunk in super().astream(input, config, stop=stop, **self._with_call_key(config, kwargs)):
            yield chunk

    # ------------------------------------------------------------------ core

    def _run(self, messages, stop, run_manager, tools=None, tool_choice=None, **kwargs) -> Iterator[tuple[str, Any]]:
        """Yield ``("text", delta)`` events, then one ``("final", dict)``."""
        tools = [] if tool_choice == "none" else list(tools or [])
        trace, ids, mode = self.render(messages, tools)
        explicit = kwargs.pop(_KEY_KWARG, None)
        key = self._thread_key(run_manager, ThreadKey(tuple(explicit)) if explicit else None)
        strategy = kwargs.pop("strategy", self.strategy)
        max_new = int(kwargs.pop("max_new_tokens", self.max_new_tokens))
        stream = self.registry.stream(key, ids, strategy=strategy, max_new_tokens=max_new,
                                      **{**self.strategy_options, **kwargs.pop("strategy_options", {})})
        _dispatch(run_manager, CONTEXT_EVENT, {"thread_key": list(key) if key else None, "messages": trace,
                                               "token_ids": list(map(int, ids)), "mode": mode})
        stops = [s for s in (stop or []) if s]
        markers = stops + ([TOOL_CALL_OPEN, "{"] if tools else [])
        emitted, text, stopped = "", "", False
        try:
            for _ in stream:
                text = self._decode_text(stream.result.output_ids)
                hits = [i for s in stops if (i := text.find(s)) >= 0]
                if hits:
                    text, stopped = text[:min(hits)], True
                visible = text[:held_back(text, markers)]
                if tools:
                    visible = visible.strip()
                visible = visible.rstrip("\ufffd")
                if len(visible) > len(emitted) and visible.startswith(emitted):
                    yield "text", visible[len(emitted):]
                    emitted = visible
                if stopped:
                    break
        finally:
            stream.close()
        res = stream.result
        parsed = parse_tool_calls(text, [t["function"]["name"] for t in tools]) if tools else ParsedOutput(content=text)
        if not parsed.content.startswith(emitted):  # pragma: no cover - held_back guards this
            raise RuntimeError("bug: streamed text is not a prefix of the final content")
        out = res.output_ids
        eos = bool(out) and out[-1] in self.engine.eos_ids
        finish = "tool_calls" if parsed.tool_calls else ("stop" if eos or stopped else "length")
        stats = _jsonable({**res.stats, "tool_mode": mode, "thread_key": list(key) if key else None})
        yield "final", {
            "content": parsed.content, "tail": parsed.content[len(emitted):], "parsed": parsed,
            "response_metadata": {"patchkv": stats, "model_name": self.model_name, "finish_reason": finish},
            "usage_metadata": {"input_tokens": len(ids), "output_tokens": len(out),
                               "total_tokens": len(ids) + len(out)},
        }

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        final = None
        for kind, payload in self._run(messages, stop, run_manager, **kwargs):
            if kind == "final":
                final = payload
        parsed: ParsedOutput = final["parsed"]
        msg = AIMessage(content=final["content"], tool_calls=parsed.tool_calls,
                        invalid_tool_calls=parsed.invalid_tool_calls,
                        response_metadata=final["response_metadata"], usage_metadata=final["usage_metadata"])
        return ChatResult(generations=[ChatGeneration(
            message=msg, generation_info={"finish_reason": final["response_metadata"]["finish_reason"]})])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for kind, payload in self._run(messages, stop, run_manager, **kwargs):
            if kind == "text":
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=payload))
                if run_manager is not None:
                    run_manager.on_llm_new_token(payload, chunk=chunk)
                yield chunk
                continue
            parsed: ParsedOutput = payload["parsed"]
            calls = [{"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": i, "type": "tool_call_chunk"}
                     for i, c in enumerate(parsed.tool_calls)]
            calls += [{"name": c["name"], "args": c["args"], "id": c["id"], "index": len(calls) + i, "type": "tool_call_chunk"}
                      for i, c in enumerate(parsed.invalid_tool_calls)]
            yield ChatGenerationChunk(
                message=AIMessageChunk(content=payload["tail"], tool_call_chunks=calls,
                                       response_metadata=payload["response_metadata"],
                                       usage_metadata=payload["usage_metadata"], chunk_position="last"),
                generation_info={"finish_reason": payload["response_metadata"]["finish_reason"]})

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return await run_in_executor(None, self._generate, messages, stop,
                                     run_manager.get_sync() if run_manager else None, **kwargs)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        sync_rm = run_manager.get_sync() if run_manager else None
        iterator = await run_in_executor(None, self._stream, messages, stop, sync_rm, **kwargs)
        done = object()
        while (item := await run_in_executor(None, next, iterator, done)) is not done:
            yield item


def _dispatch(run_manager, name: str, data: dict) -> None:
    """Send a custom event to the run's handlers, with the model run's id (a recorder matches it to the
    run's ``on_chat_model_start``); ``CallbackManagerForLLMRun.on_custom_event`` itself is a no-op."""
    if run_manager is None or not run_manager.handlers:
        return
    handle_event(run_manager.handlers, "on_custom_event", "ignore_custom_event", name, data,
                 run_id=run_manager.run_id, tags=run_manager.tags, metadata=run_manager.metadata)


def _native(trace: list[dict]) -> list[dict]:
    """Trace-format messages (docs/TRACES.md) in the OpenAI-style form chat templates with tool support expect."""
    out = []
    for m in trace:
        d = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            d["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["name"], "arguments": c.get("args", {})}}
                               for c in m["tool_calls"]]
        if m["role"] == "tool":
            d["tool_call_id"] = m.get("tool_call_id")
        out.append(d)
    return out

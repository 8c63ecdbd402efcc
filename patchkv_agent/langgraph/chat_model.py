"""``PatchKVChatModel``: a LangChain chat model over a local Hugging Face model with per-thread KV reuse.

Each call renders the messages with the tokenizer's chat template, finds its thread key (the one set by
:class:`~patchkv_agent.langgraph.middleware.PatchKVMiddleware` or :func:`~patchkv_agent.langgraph.node.patchkv_node`,
else ``configurable.thread_id`` + namespace of the run config, else ``default_thread_id``) and resumes
that thread's previous context version through a :class:`~patchkv_agent.runtime.threads.ThreadRegistry`
(diff, plan, restore, recompute), then decodes token by token: greedy, or sampled with ``temperature`` /
``top_p`` / ``seed`` (same seed, same context: same output). The resume stats of each call are in
``AIMessage.response_metadata["patchkv"]``: the JSON form of its
:class:`~patchkv_agent.results.ResumeStats`, whose call part this model fills (tool mode, thread key,
grammar, sampling).

Tools (``bind_tools``): rendered with ``tools=`` by chat templates that use it; otherwise (SmolLM2's
template ignores it) the JSON protocol of :mod:`~patchkv_agent.langgraph.tools` is appended to the
system prompt, and earlier calls/results are written back as text (:func:`~patchkv_agent.langgraph.tools.plain_messages`).
With ``constrained=True`` (default) the decode runs under a grammar (:mod:`~patchkv_agent.langgraph.grammar`,
xgrammar) inside the same decode path: ``tool_choice="any"``/``"required"`` or a tool's name forces one
call whose arguments match the tool's JSON schema; ``"auto"``/None lets the model write text or a
schema-valid call; ``"none"`` hides the tools. A call cut off by the token limit is an
``invalid_tool_calls`` entry with ``finish_reason="length"``, never a repaired call.
``with_structured_output`` supports ``json_schema`` (default), ``json_mode`` and ``function_calling``, each
grammar-enforced.

Streaming yields one chunk per decoded token whose text is final: while tools are bound, text from a
possible call start (``<tool_call>``) on is held back and the last chunk carries the rest and the parsed
calls, so the concatenated stream equals the non-streamed message. Async methods run the sync path in
an executor. Content must be text (strings or ``{"type": "text"}`` blocks); other blocks raise.

Knows LangChain's chat-model interface, the registry and the engine's public methods; nothing about graphs.
"""

from __future__ import annotations

import json
import logging
from operator import itemgetter
from typing import Any, AsyncIterator, Iterator, Literal, Sequence

import numpy as np

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.callbacks.manager import handle_event
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables.config import ensure_config, run_in_executor
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr, model_validator

from ..core.sampling import Sampler, SamplingParams
from ..results import SamplingInfo
from ..runtime.threads import ThreadKey, ThreadRegistry
from .keys import current_thread_key, thread_key_from_config, thread_key_from_metadata
from .predict import check_not_pending
from .tools import (PROTOCOL_TAGS, TOOL_CALL_OPEN, ParsedOutput, check_json_text, held_back, new_call_id,
                    parse_tool_calls, plain_messages, to_trace_messages, tool_schemas, with_tool_protocol)

log = logging.getLogger(__name__)
_KEY_KWARG = "patchkv_thread_key"
CONTEXT_EVENT = "patchkv_context"  # custom callback event: the rendered context of a call (for recorders)
_PROBE_TOOL = {"type": "function", "function": {"name": "patchkv_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
CALL_KWARGS = ("tools", "tool_choice", "response_format", "strategy", "strategy_options", "max_new_tokens",
               "max_tokens", "temperature", "top_p", "seed")
STRUCTURED_METHODS = ("json_schema", "json_mode", "function_calling")


def grammar_compiler(engine):
    """The :class:`~patchkv_agent.langgraph.grammar.GrammarCompiler` of an engine's tokenizer, compiled once per
    engine (:class:`~patchkv_agent.langgraph.grammar.GrammarCompilers`)."""
    from .grammar import GRAMMARS, GrammarCompiler

    return GRAMMARS.compiler_for(engine, lambda: GrammarCompiler(engine.tokenizer, engine.spec.vocab_size,
                                                                 engine.eos_ids))


def structured_instruction(response_format: dict) -> str:
    """The system-prompt line that tells the model what JSON to write (the grammar enforces it)."""
    if response_format.get("type") == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema", js)
        return "Reply with only a JSON object that matches this JSON schema:\n" + json.dumps(schema, separators=(",", ":"))
    return "Reply with only a JSON object."


class PatchKVChatModel(BaseChatModel):
    """Chat model over a :class:`~patchkv_agent.engine.PatchKVEngine` that reuses KV per agent thread.

    Build it with :meth:`from_pretrained` (engine, registry and chat model in one call),
    ``PatchKVChatModel(registry=ThreadRegistry(engine))`` (share the registry with the middleware / node
    wrapper / checkpointer) or ``PatchKVChatModel(engine=engine)`` (a registry of its own).

    Attributes:
        registry: the :class:`~patchkv_agent.runtime.threads.ThreadRegistry` holding the threads' KV.
        strategy: resume strategy when a thread has KV (``patchkv``, ``prefix``, ``direct``, ``exact`` ...).
        strategy_options: options for the strategy (``dirty_window=``, ``kappa=`` ...).
        max_new_tokens: tokens per call at most (alias ``max_tokens``; also per call, under either name).
        temperature: 0 (default) greedy; > 0 samples (also per call).
        top_p: nucleus mass for sampling (also per call).
        seed: sampling seed (also per call); the same seed and context give the same output.
        stop: stop sequences (merged with a call's ``stop``).
        streaming: ``invoke`` streams internally (callbacks see each token).
        constrained: decode tool calls and structured output under a grammar (False: free decoding read
            by the tolerant parser, bare JSON calls included).
        default_thread_id: thread for calls that name none (None, the default: such calls are exact and
            keep no state, so unrelated conversations never share KV).
        tool_protocol: ``auto`` (template when it renders ``tools=``, else JSON), ``template`` or ``json``.
        model_name: reported in ``response_metadata["model_name"]`` and LangSmith params (default: the
            name or path the engine's model was loaded from, else its config's ``_name_or_path``).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    registry: Any = Field(exclude=True)
    strategy: str = "patchkv"
    strategy_options: dict[str, Any] = Field(default_factory=dict)
    max_new_tokens: int = Field(default=128, ge=0, validation_alias=AliasChoices("max_new_tokens", "max_tokens"))
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False
    constrained: bool = True
    default_thread_id: str | None = None
    tool_protocol: Literal["auto", "template", "json"] = "auto"
    model_name: str | None = None
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
            raise ValueError("PatchKVChatModel needs registry=ThreadRegistry(engine) or engine=PatchKVEngine(...) "
                             "(or use PatchKVChatModel.from_pretrained(name))")
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _default_name(self) -> "PatchKVChatModel":
        if self.model_name is None:
            m = self.engine.model
            self.model_name = (self.engine.source or getattr(m.config, "_name_or_path", None)
                               or m.config.model_type)
        return self

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, *, dtype: Any = None, device: str = "cpu",
                        settings: Any = None, profile: Any = "auto", profile_dirs: Sequence[str] = (),
                        registry_options: dict[str, Any] | None = None, **fields: Any) -> "PatchKVChatModel":
        """Load a model and build engine, registry and chat model in one call.

        Args:
            name_or_path: ``"smollm2-135m"`` (default), an HF id, a local directory or a ``.gguf`` path.
            dtype: parameter dtype (default float32).
            device: where the model runs.
            settings, profile, profile_dirs: the engine's recovery settings, as for
                :class:`~patchkv_agent.engine.PatchKVEngine` (``settings=RecoverySettings(kappa=...)``; a
                profile is looked up only without ``settings``).
            registry_options: :class:`~patchkv_agent.runtime.threads.ThreadRegistry` options (budgets, store ...).
            **fields: chat-model fields (``max_tokens``, ``temperature``, ``strategy``, ``strategy_options`` ...).

        Returns:
            The chat model (``.engine``, ``.registry`` reach the rest).

        Raises:
            FileNotFoundError, ValueError: see :func:`patchkv_agent.loading.load_model`.
            TypeError: a keyword that is not a chat-model field (engine settings go in ``settings=``).
        """
        import torch

        from ..engine import PatchKVEngine
        from ..loading import DEFAULT_MODEL

        known = set(cls.model_fields) | {"max_tokens"}
        bad = sorted(k for k in fields if k not in known or k == "registry")
        if bad:
            raise TypeError(f"PatchKVChatModel.from_pretrained got {bad}, which are not chat-model fields; engine "
                            "settings go in settings=RecoverySettings(...), registry options in registry_options=")
        engine = PatchKVEngine.from_pretrained(name_or_path or DEFAULT_MODEL, dtype=dtype or torch.float32,
                                               device=device, settings=settings, profile=profile,
                                               profile_dirs=profile_dirs)
        return cls(registry=ThreadRegistry(engine, **(registry_options or {})), **fields)

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
                "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                "constrained": self.constrained, "fingerprint": self.engine.spec.fingerprint[:16]}

    def _get_llm_string(self, stop: list[str] | None = None, **kwargs: Any) -> str:
        """LangChain's cache key of a call's model and parameters, without the graph thread it runs in (the
        same prompt with the same parameters decodes the same output in any thread)."""
        kwargs.pop(_KEY_KWARG, None)
        return super()._get_llm_string(stop=stop, **kwargs)

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        name = kwargs["model"] if isinstance(kwargs.get("model"), str) else self.model_name  # (a call with model= raises)
        params = LangSmithParams(ls_provider="patchkv", ls_model_name=name, ls_model_type="chat",
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens)))
        stops = stop or self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    # ------------------------------------------------------------- tokens

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the model's own tokenizer (no special tokens added)."""
        if self.engine.tokenizer is None:
            raise ValueError("PatchKVChatModel needs an engine with a tokenizer")
        return list(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence | None = None) -> int:
        """Tokens of the context these messages (and tools) render to with the model's chat template,
        generation prompt included: exactly what a call would prefill."""
        return len(self.render(messages, tool_schemas(tools) if tools else None)[1])

    # ------------------------------------------------------------- binding

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | dict | bool | None = None, **kwargs: Any):
        """Bind tools (LangChain tools, functions, pydantic classes or OpenAI-format dicts).

        Args:
            tools: the tools.
            tool_choice: ``"auto"``/None (text or a call), ``"any"``/``"required"``/True (a call of some
                bound tool), a tool name or ``{"type": "function", "function": {"name": ...}}`` (a call of
                that tool), ``"none"`` (no call).
            **kwargs: other call arguments (``max_tokens``, ``temperature`` ...).

        Returns:
            A runnable that passes the tools' OpenAI-format schemas to every call.

        Raises:
            ValueError: a ``tool_choice`` that names no bound tool or is not one of the forms above.
        """
        from .grammar import spec_for

        schemas = tool_schemas(tools)
        spec_for(tools=schemas, tool_choice=tool_choice)  # validate now, not at the first call
        return self.bind(tools=schemas, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: Any = None, *, method: str = "json_schema", include_raw: bool = False,
                               strict: bool | None = None, **kwargs: Any):
        """Output parsed into ``schema`` (pydantic class, TypedDict, JSON schema or OpenAI function dict).

        Args:
            schema: the output schema (may be None for ``json_mode``: any JSON object).
            method: ``json_schema`` (grammar = the schema), ``json_mode`` (grammar = a JSON object; with a
                schema, the schema), or ``function_calling`` (a forced tool call whose arguments match it).
            include_raw: return ``{"raw", "parsed", "parsing_error"}``.
            strict: accepted for compatibility; the grammar always enforces the schema.

        Returns:
            A runnable returning the parsed output.

        Raises:
            ValueError: an unknown method or keyword argument, a method that needs a schema without one, or
                a schema LangChain cannot convert.
            TypeError: a schema of the wrong type (a string, a list, a number, an empty dict).
        """
        from langchain_core.output_parsers import JsonOutputKeyToolsParser, PydanticToolsParser
        from langchain_core.runnables import RunnableMap, RunnablePassthrough
        from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
        from langchain_core.utils.pydantic import is_basemodel_subclass

        if kwargs:
            raise ValueError(f"with_structured_output: unsupported arguments {sorted(kwargs)}; supported: schema, "
                             f"method, include_raw, strict")
        if method not in STRUCTURED_METHODS:
            raise ValueError(f"with_structured_output: unknown method {method!r}; supported: {list(STRUCTURED_METHODS)}")
        if schema is None and method != "json_mode":
            raise ValueError(f"with_structured_output(method={method!r}) needs a schema (json_mode works without one)")
        if schema is not None and (isinstance(schema, (str, bytes, list, tuple, set, int, float, bool))
                                   or (isinstance(schema, dict) and not schema)):
            raise TypeError(f"with_structured_output: schema must be a pydantic class, a TypedDict, a JSON schema dict "
                            f"or an OpenAI function dict, got {type(schema).__name__} {schema!r:.60}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format = {"kwargs": {"method": method}, "schema": schema}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=ls_format)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        else:
            if schema is None:  # any JSON object, under the json_object grammar (no schema to trace)
                rf: dict[str, Any] = {"type": "json_object"}
                llm = self.bind(response_format=rf)
            else:
                try:
                    js = (schema.model_json_schema() if is_pydantic and hasattr(schema, "model_json_schema")
                          else convert_to_json_schema(schema))
                except (ValueError, TypeError, KeyError, AttributeError) as e:
                    first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
                    raise ValueError(f"with_structured_output: cannot read a JSON schema from {schema!r:.60}: "
                                     f"{first}") from None
                rf = {"type": "json_schema", "json_schema": {"name": js.get("title", "output"), "schema": js}}
                llm = self.bind(response_format=rf, ls_structured_output_format=ls_format)
            parser = _CompletePydantic(pydantic_object=schema) if is_pydantic else _CompleteJson()
        if include_raw:
            assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
            none = RunnablePassthrough.assign(parsed=lambda _: None)
            return RunnableMap(raw=llm) | assign.with_fallbacks([none], exception_key="parsing_error")
        return llm | parser

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

    def render(self, messages: Sequence[BaseMessage], tools: Sequence[dict] | None = None,
               response_format: dict | None = None) -> tuple[list[dict], np.ndarray, str]:
        """The context one call sees.

        Args:
            messages: the conversation.
            tools: OpenAI-format tool schemas (bound tools).
            response_format: structured output (its instruction is appended to the system prompt).

        Returns:
            ``(trace_messages, token_ids, mode)``: trace-format messages (docs/TRACES.md) as the model saw
            them (JSON protocol included), their ids (an int64 array from the engine's memoized encoder:
            the form the resume checks in one pass), and ``mode`` one of ``plain``, ``json``, ``template``. For ``plain`` and
            ``json``, ``patchkv-agent replay`` renders ``trace_messages`` to the same ids. Message strings
            (contents, roles, tool calls) and tool schemas are text: a special token's text inside them, and
            the tool protocol's tags (:data:`~patchkv_agent.langgraph.tools.PROTOCOL_TAGS`), are broken
            first (:meth:`~patchkv_agent.core.encoding.SegmentEncoder.as_text`, after a message's text parts
            are joined), so the only special tokens in the ids are the chat template's own (a tool output
            cannot forge a turn) and each tool result has one ``<tool_response>`` wrapper.

        Raises:
            ValueError: the engine has no tokenizer; a message with non-text content; text a tokenizer
                cannot encode (a lone surrogate, a text part that is not a string, bytes or other non-JSON
                values in tool-call arguments or tool schemas), naming the field (``messages[3].content``).
        """
        if self.engine.tokenizer is None:
            raise ValueError("PatchKVChatModel needs an engine with a tokenizer (it renders chat templates)")
        trace = to_trace_messages(messages)
        if response_format is not None:
            trace = _with_system(trace, structured_instruction(response_format))
        if tools:
            check_json_text(list(tools), "tools")
        # message text is text, not turn markers or protocol tags
        trace, tools = self.engine.encoder.as_text((trace, tools), also=PROTOCOL_TAGS)
        if not tools:
            return trace, self.engine.encode_array(plain_messages(trace)), "plain"
        use_template = self.tool_protocol == "template" or (self.tool_protocol == "auto" and self.template_renders_tools())
        if use_template:
            try:
                tok = self.engine.tokenizer
                text = tok.apply_chat_template(_native(trace), tools=list(tools), tokenize=False,
                                               add_generation_prompt=True)
                return trace, self.engine.encoder.encode(text), "template"
            except Exception as e:  # a template that takes tools= but not tool-call messages
                log.warning("chat template failed on tool messages (%s); using the JSON tool protocol", e)
        trace = with_tool_protocol(trace, tools)
        return trace, self.engine.encode_array(plain_messages(trace)), "json"

    def _decode_text(self, output_ids: list[int]) -> str:
        """Text of the output so far (subclasses may override, e.g. to script replies in tests)."""
        return self.engine.tokenizer.decode(output_ids, skip_special_tokens=True)

    def _thread_key(self, run_manager, explicit: ThreadKey | None) -> ThreadKey | None:
        """Key precedence: middleware / node wrapper, the config passed to this call, the graph run's
        config, the run's callback metadata, ``default_thread_id``.

        A middleware's internal call (LangChain marks it with ``lc_source`` in the call's metadata, e.g.
        ``SummarizationMiddleware``'s summarizer) is another context of the same thread: it gets the scope
        ``#<lc_source>`` so it never diffs against the agent's context (the registry also keeps a thread's
        recent contexts apart when no such mark is given: ``ThreadRegistry(contexts=...)``)."""
        meta = getattr(run_manager, "metadata", None) or {}
        key = current_thread_key()
        if key is None:
            key = explicit
        if key is None:
            conf = ensure_config()
            if (conf.get("configurable") or {}).get("thread_id") is not None:
                key = thread_key_from_config(conf)
            else:
                key = thread_key_from_metadata(meta, default_thread_id=self.default_thread_id)
        source = meta.get("lc_source")
        if key is not None and isinstance(source, str) and source and "#" not in key[1]:
            key = ThreadKey((key[0], f"{key[1]}#{source[:64]}"))
        return key

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

    def _call_options(self, kwargs: dict) -> dict[str, Any]:
        """Validated per-call options (call kwargs over fields). Raises TypeError on unknown arguments."""
        kwargs = {k: v for k, v in kwargs.items() if k not in ("ls_structured_output_format", "stream")}
        unknown = sorted(set(kwargs) - set(CALL_KWARGS) - {_KEY_KWARG})
        if unknown:
            raise TypeError(f"PatchKVChatModel: unsupported call arguments {unknown}; supported: {list(CALL_KWARGS)}")
        if "max_tokens" in kwargs and "max_new_tokens" in kwargs and kwargs["max_tokens"] != kwargs["max_new_tokens"]:
            raise TypeError("pass max_tokens or max_new_tokens (the same thing), not both")
        max_new = kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens))
        if max_new is None or int(max_new) < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_new}")
        params = SamplingParams(temperature=float(kwargs.get("temperature", self.temperature)),
                                top_p=float(kwargs.get("top_p", self.top_p)), seed=kwargs.get("seed", self.seed))
        return {"max_new": int(max_new), "params": params, "tools": kwargs.get("tools"),
                "tool_choice": kwargs.get("tool_choice"), "response_format": kwargs.get("response_format"),
                "strategy": kwargs.get("strategy", self.strategy),
                "strategy_options": {**self.strategy_options, **(kwargs.get("strategy_options") or {})},
                "key": kwargs.get(_KEY_KWARG)}

    def _run(self, messages, stop, run_manager, **kwargs) -> Iterator[tuple[str, Any]]:
        """Yield ``("text", delta)`` events, then one ``("final", dict)``."""
        from .grammar import spec_for

        check_not_pending(messages)  # a call made while predicting must not read a pending tool result
        opt = self._call_options(kwargs)
        tool_choice, rf = opt["tool_choice"], opt["response_format"]
        tools = tool_schemas(opt["tools"]) if opt["tools"] is not None else []  # checks call-time tools too
        if isinstance(tool_choice, str) and tool_choice == "none":
            tools = []
        spec = spec_for(tools=tools, tool_choice=tool_choice, response_format=rf)  # validates either way
        if rf is not None and tools:
            raise ValueError("pass tools or response_format (structured output), not both")
        trace, ids, mode = self.render(messages, tools, rf)
        processor = grammar_compiler(self.engine).processor(spec) if (spec and self.constrained) else None
        sampler = Sampler(opt["params"], processor)
        explicit = opt["key"]
        key = self._thread_key(run_manager, ThreadKey(tuple(explicit)) if explicit else None)
        strategy = self.engine.strategy(opt["strategy"], opt["strategy_options"])  # options checked by name
        stream = self.registry.stream(key, ids, strategy=strategy, max_new_tokens=opt["max_new"], sampler=sampler)
        _dispatch(run_manager, CONTEXT_EVENT, lambda: {"thread_key": list(key) if key else None, "messages": trace,
                                                       "token_ids": ids.tolist(), "mode": mode})
        stops = [s for s in list(stop or []) + list(self.stop or []) if s]
        markers = stops + ([TOOL_CALL_OPEN] + ([] if self.constrained else ["{"]) if tools else [])
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
        out = res.output_ids
        eos = bool(out) and out[-1] in self.engine.eos_ids
        complete = eos or stopped or sampler.done
        if tools:
            parsed = parse_tool_calls(text, [t["function"]["name"] for t in tools], bare=not self.constrained,
                                      truncated=not complete)
        else:
            parsed = ParsedOutput(content=text)
        if (processor is not None and spec["kind"] == "forced_call" and not complete and not parsed.tool_calls
                and not parsed.invalid_tool_calls):
            # cut off before the call's opening tag was complete (or before any token): under the grammar
            # every token is the call's, so this is a cut-off call, not text
            parsed = ParsedOutput(content="", invalid_tool_calls=[{
                "name": None, "args": text.strip(), "id": new_call_id(), "type": "invalid_tool_call",
                "error": "tool call cut off by the token limit (raise max_tokens)"}])
        if not parsed.content.startswith(emitted):  # pragma: no cover - held_back guards this
            raise RuntimeError("bug: streamed text is not a prefix of the final content")
        if parsed.tool_calls and not parsed.invalid_tool_calls:
            finish = "tool_calls"  # every call complete (even if text after them was cut off)
        else:
            finish = "stop" if complete else "length"
        params, grammar = opt["params"], processor is not None
        stats = res.stats.with_call(
            tool_mode=mode, thread_key=tuple(key) if key else None, grammar=spec["kind"] if grammar else None,
            sampling=SamplingInfo(temperature=params.temperature, top_p=params.top_p, seed=params.seed),
            grammar_mask_s=processor.mask_s if grammar else None, grammar_steps=processor.steps if grammar else None)
        res.stats = stats
        yield "final", {
            "content": parsed.content, "tail": parsed.content[len(emitted):], "parsed": parsed,
            "response_metadata": {"patchkv": stats.to_json(), "model_name": self.model_name, "finish_reason": finish},
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


def _check_complete(result) -> None:
    from langchain_core.exceptions import OutputParserException

    msg = getattr(result[0], "message", None) if result else None
    if msg is not None and (msg.response_metadata or {}).get("finish_reason") == "length":
        raise OutputParserException("structured output cut off by the token limit (raise max_tokens): "
                                    + str(msg.content)[:200])


def _parsers():
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser

    class CompleteJson(JsonOutputParser):
        """JSON output; the final (non-partial) parse of an output cut off by max_tokens raises."""

        def parse_result(self, result, *, partial: bool = False):
            if not partial:
                _check_complete(result)
            return super().parse_result(result, partial=partial)

    class CompletePydantic(PydanticOutputParser):
        """Pydantic output; the final parse of an output cut off by max_tokens raises."""

        def parse_result(self, result, *, partial: bool = False):
            if not partial:
                _check_complete(result)
            return super().parse_result(result, partial=partial)

    return CompleteJson, CompletePydantic


_CompleteJson, _CompletePydantic = _parsers()


def _dispatch(run_manager, name: str, build_data) -> None:
    """Send a custom event to the run's handlers, with the model run's id (a recorder matches it to the
    run's ``on_chat_model_start``); ``CallbackManagerForLLMRun.on_custom_event`` itself is a no-op.
    ``build_data()`` makes the event's dict, called only when there are handlers."""
    if run_manager is None or not run_manager.handlers:
        return
    handle_event(run_manager.handlers, "on_custom_event", "ignore_custom_event", name, build_data(),
                 run_id=run_manager.run_id, tags=run_manager.tags, metadata=run_manager.metadata)


def _with_system(trace: list[dict], text: str) -> list[dict]:
    """Trace messages with ``text`` appended to the system message (one is added first if none)."""
    out = [dict(m) for m in trace]
    if out and out[0].get("role") == "system":
        out[0]["content"] = ((out[0].get("content") or "") + "\n\n" + text).strip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


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

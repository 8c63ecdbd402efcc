"""LangChain's own standard test suites (``langchain-tests``) on PatchKVChatModel.

On a tiny random llama with a char-level ChatML tokenizer (CI): the contract: interfaces, streaming,
async, usage metadata, stop sequences, tool calls and structured output that a random model can only
produce because the grammar forces them. On the embedded SmolLM2-135M (``slow``): the same suites on a
real model. Flags say what PatchKVChatModel supports; nothing is skipped to hide a failure.

``python -m pytest -q tests/test_langchain_standard.py`` (``-m slow`` for SmolLM2).
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import chat_engine  # noqa: E402

from patchkv_agent.langgraph import PatchKVChatModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Flags:
    """What PatchKVChatModel supports (the same for every model it runs)."""

    @property
    def chat_model_class(self):
        return PatchKVChatModel

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": [], "stream": []}

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def enable_vcr_tests(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine per chat model; a call with model= raises


@functools.lru_cache(maxsize=None)
def _tiny():
    return chat_engine()


class TestTinyUnit(_Flags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"engine": _tiny()}


class TestTinyIntegration(_Flags, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        return {"engine": _tiny()}


# A random-weight model cannot pick meaningful values: the grammar makes its calls and JSON valid (e.g.
# magic_function(input=141), inside the schema's -1000..1000), but not the value the prompt asks for
# (3), a non-empty argument, or a string that ends before max_tokens; under tool_choice="auto" it never
# chooses to call. These tests check what the model chose, so they are expected to fail here (strict:
# a pass would be news) and run on SmolLM2 in TestSmolLM2Integration.
_TINY_XFAIL = {"test_tool_calling": "random model: schema-valid call with input=141, not 3",
               "test_tool_calling_async": "random model: schema-valid call with input=141, not 3",
               "test_bind_runnables_as_tools": "random model: answer_style is an empty string",
               "test_structured_output": "random model: the setup string repeats until max_tokens (cut off: raises)",
               "test_structured_output_async": "random model: the setup string repeats until max_tokens (cut off: raises)",
               "test_structured_output_pydantic_2_v1": "random model: the setup string repeats until max_tokens",
               "test_structured_output_optional_param": "random model: the setup string repeats until max_tokens",
               "test_json_mode": "random model: the setup string repeats until max_tokens",
               "test_agent_loop": "random model never chooses a call under tool_choice=auto",
               "test_unicode_tool_call_integration": "random model: the name string repeats until max_tokens"}


def _mark_xfails(cls, expected: dict[str, str]) -> None:
    """Mark ``expected`` tests of ``cls`` xfail (strict) without touching the shared base class.

    ``pytest.mark.xfail(...)(f)`` stores the mark on ``f`` itself; applied to the inherited function it
    would mark every subclass, the SmolLM2 one too. Each mark goes on a per-class wrapper instead.
    """
    for name, reason in expected.items():
        base = getattr(ChatModelIntegrationTests, name)

        if inspect.iscoroutinefunction(base):
            @functools.wraps(base)
            async def wrapper(self, *args, _base=base, **kwargs):
                return await _base(self, *args, **kwargs)
        else:
            @functools.wraps(base)
            def wrapper(self, *args, _base=base, **kwargs):
                return _base(self, *args, **kwargs)

        wrapper.pytestmark = list(getattr(base, "pytestmark", []))  # own list: the parametrize marks
        setattr(cls, name, pytest.mark.xfail(reason=reason, strict=True)(wrapper))


_mark_xfails(TestTinyIntegration, _TINY_XFAIL)


# ------------------------------------------------------------------------------------------ SmolLM2


@functools.lru_cache(maxsize=None)
def _smollm2():
    from patchkv_agent import PatchKVEngine

    return PatchKVEngine.from_pretrained("smollm2-135m")


@pytest.mark.slow
class TestSmolLM2Unit(_Flags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"engine": _smollm2()}


@pytest.mark.slow
class TestSmolLM2Integration(_Flags, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        return {"engine": _smollm2()}


# Measured on SmolLM2-135M-Instruct (greedy, the suite's max_tokens): under the grammar every string stays
# schema-valid, but the model's joke setup repeats ("The cat was a cat, and the cat was a cat, ...") until
# the token limit, so the structured output is cut off and raises; under tool_choice="auto" it answers the
# agent-loop prompt in prose and never calls the weather tool. The other 37 tests pass on this model,
# tool calling with forced choice included.
_SMOL_XFAIL = {name: "SmolLM2-135M: the joke setup repeats until max_tokens (cut off: raises)"
               for name in ("test_structured_output", "test_structured_output_async",
                            "test_structured_output_pydantic_2_v1", "test_structured_output_optional_param")}
_SMOL_XFAIL["test_agent_loop"] = "SmolLM2-135M answers in prose under tool_choice=auto (never calls the tool)"

_mark_xfails(TestSmolLM2Integration, _SMOL_XFAIL)

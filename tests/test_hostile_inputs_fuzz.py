"""Property tests over the parsers of outside input added with the preparation path: a KV handle read back
from a graph checkpoint (``ThreadRegistry.expect``) and the messages a chat model renders (text, text parts,
tool calls). Whatever the value, the outcome is the parsed value or a ``ValueError`` that names the field;
never another exception, and a refused handle changes nothing."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="needs the test extra: pip install 'patchkv-agent[test]'")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402

from patchkv_agent.langgraph import PatchKVChatModel  # noqa: E402
from patchkv_agent.runtime.keys import handle_shape_problem  # noqa: E402
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key  # noqa: E402
from tiny_models import chat_engine  # noqa: E402

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=True) | st.text(max_size=12)
    | st.binary(max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)
HANDLE_KEYS = ("thread_id", "checkpoint_ns", "version", "ids_hash", "kv_ids_hash")
HANDLES = st.dictionaries(st.sampled_from(HANDLE_KEYS), JSONISH, max_size=5) | JSONISH
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def reg():
    r = ThreadRegistry(chat_engine())
    yield r
    r.close()


@SETTINGS
@given(handle=HANDLES)
def test_any_handle_is_noted_or_refused_with_a_value_error_and_nothing_changes(reg, handle):
    key = thread_key("fuzzed-handle")
    before = reg.table.peek(key)
    version = before.version if before is not None else 0
    try:
        reg.expect(key, handle)
    except ValueError as e:
        assert handle_shape_problem(handle) is not None and "the KV handle" in str(e)
        after = reg.table.peek(key)
        assert (after.version if after is not None else 0) == version
    else:
        assert handle_shape_problem(handle) is None


TEXT = st.text(max_size=20) | st.sampled_from(["\ud800", "a\udfffb", "<|im_start|>system", "</tool_response>"])
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | JSONISH})
CONTENT = TEXT | st.lists(PART | TEXT, max_size=3)
ARGS = st.dictionaries(st.text(max_size=6), JSONISH | TEXT, max_size=3)


@pytest.fixture(scope="module")
def model():
    return PatchKVChatModel(engine=chat_engine(), max_tokens=4)


@SETTINGS
@given(human=CONTENT, args=ARGS, result=CONTENT)
def test_any_message_content_renders_or_raises_a_value_error_naming_the_field(model, human, args, result):
    try:
        msgs = [HumanMessage(content=human), AIMessage(content="", tool_calls=[{"name": "f", "args": args, "id": "c1"}]),
                ToolMessage(content=result, tool_call_id="c1")]
    except (ValueError, TypeError):  # LangChain's own message validation (pydantic), before ours
        return
    try:
        _, ids, _ = model.render(msgs, [])
    except ValueError as e:
        assert "messages[" in str(e), str(e)
    else:
        assert len(ids) > 0

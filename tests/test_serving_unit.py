"""The serving path's parts that need no serving engine: the bounded HTTP client against hostile answers, the
adapters' checks of what they read back, the endpoint and payload taken from the agent's own model, the
per-call stats, and the prediction's bounds (placeholders, prepared calls per thread, greedy only, waits).
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from patchkv_agent.serving.adapter import PrewarmReply, count, token_ids
from patchkv_agent.serving.engines import adapter_for
from benchmarks.server_bench import decoded_tokens, near_tie
from patchkv_agent.serving.http import Endpoint, Exchange, ServerError
from patchkv_agent.serving.stats import ServerCallStats


class _Server:
    """A loopback HTTP server whose every answer ``handler(h)`` writes."""

    def __init__(self, handler):
        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                self.body = self.rfile.read(n)
                handler(self)

            do_GET = do_POST

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.srv.server_address[1]}")
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


def _answer(body: bytes, status: int = 200, length: int | None = None, close: bool = False):
    def h(r):
        r.send_response(status)
        r.send_header("Content-Length", str(len(body) if length is None else length))
        r.end_headers()
        r.wfile.write(body)
        if close:
            r.close_connection = True
            r.wfile.flush()
            r.connection.shutdown(2)
    return h


@pytest.mark.parametrize("body,status,kind", [
    (b'{"tokens": [1]}', 503, "status"), (b"<html>", 200, "malformed"), (b"[1, 2]", 200, "malformed"),
    (b'"text"', 200, "malformed"), (b"\xff\xfe", 200, "malformed")])
def test_an_answer_that_is_not_a_json_object_is_a_server_error_of_its_kind(body, status, kind):
    srv = _Server(_answer(body, status))
    try:
        with pytest.raises(ServerError) as e:
            Exchange(srv.endpoint).post("/tokenize", {})
        assert e.value.kind == kind and (e.value.status == status if kind == "status" else True)
    finally:
        srv.close()


def test_a_declared_or_streamed_body_over_the_limit_fails_before_it_is_held():
    declared = _Server(_answer(b"{}", length=1 << 30, close=True))
    def stream(r):
        r.send_response(200)
        r.send_header("Connection", "close")
        r.end_headers()
        try:
            for _ in range(4096):  # 256 MiB offered, 64 KiB at a time
                r.wfile.write(b"1" * 65536)
        except OSError:
            pass
    streamed = _Server(stream)
    try:
        tracemalloc.start()
        for srv in (declared, streamed):
            with pytest.raises(ServerError) as e:
                Exchange(srv.endpoint, max_bytes=1 << 20).post("/x", {})
            assert e.value.kind == "too_large"
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 8 << 20  # a few chunks past the 1 MiB limit, never the body
    finally:
        declared.close()
        streamed.close()


def test_a_short_body_a_stalled_one_and_an_abort_are_each_named():
    short = _Server(_answer(b'{"a"', length=100, close=True))
    def stall(r):
        r.send_response(200)
        r.send_header("Content-Length", "100")
        r.end_headers()
        r.wfile.write(b'{"a": ')
        r.wfile.flush()
        time.sleep(3)
    stalled = _Server(stall)
    try:
        with pytest.raises(ServerError) as e:
            Exchange(short.endpoint).post("/x", {})
        assert e.value.kind == "truncated"
        with pytest.raises(ServerError) as e:
            Exchange(stalled.endpoint, timeout_s=0.5).post("/x", {})
        assert e.value.kind == "timeout"
        ex = Exchange(stalled.endpoint, timeout_s=10)
        threading.Timer(0.3, ex.abort).start()
        t0 = time.monotonic()
        with pytest.raises(ServerError) as e:
            ex.post("/x", {})
        assert e.value.kind == "aborted" and time.monotonic() - t0 < 2.5
        with pytest.raises(ServerError) as e:
            ex.post("/x", {})  # an aborted exchange starts nothing more
        assert e.value.kind == "aborted"
    finally:
        short.close()
        stalled.close()


def test_nothing_listening_is_unreachable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError) as e:
        Exchange(Endpoint(f"http://127.0.0.1:{port}"), timeout_s=1).get("/version")
    assert e.value.kind == "unreachable"


def test_token_ids_and_counts_read_back_are_checked():
    assert token_ids([0, 5, 49151], "t") == [0, 5, 49151]
    for bad in ([1, -1], [1, 2.0], [True], ["1"], [1 << 31], {"a": 1}, None, "123"):
        with pytest.raises(ServerError, match="malformed|token"):
            token_ids(bad, "t")
    assert count(None, "c") is None and count(7, "c") == 7
    for bad in (-1, 1.5, True, "3", 1 << 31):
        with pytest.raises(ServerError):
            count(bad, "c")


def test_the_vllm_adapter_refuses_a_rendering_whose_count_disagrees_and_reads_cached_tokens():
    from patchkv_agent.serving.vllm import VLLMAdapter

    lie = _Server(_answer(json.dumps({"tokens": [1, 2, 3], "count": 4}).encode()))
    ok = _Server(_answer(json.dumps({"usage": {"prompt_tokens": 300, "prompt_tokens_details": {"cached_tokens": 256}}}).encode()))
    try:
        with pytest.raises(ServerError, match="count 4 for 3"):
            VLLMAdapter().render(Exchange(lie.endpoint), {"messages": []})
        assert VLLMAdapter().prewarm(Exchange(ok.endpoint), "m", [1, 2], "s") == PrewarmReply(300, 256)
    finally:
        lie.close()
        ok.close()


def test_a_vllm_that_refuses_priority_is_sent_none_from_then_on():
    from patchkv_agent.serving.vllm import VLLMAdapter

    seen = []
    usage = json.dumps({"usage": {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}}).encode()
    refusal = json.dumps({"error": {"message": "Got priority 1 but Priority scheduling is not enabled."}}).encode()

    def h(r):
        body = json.loads(r.body)
        seen.append(body.get("priority"))
        _answer(refusal, status=400)(r) if "priority" in body else _answer(usage)(r)

    srv = _Server(h)
    try:
        ad = VLLMAdapter()
        assert ad.prewarm(Exchange(srv.endpoint), "m", [1, 2], None, priority=1) == PrewarmReply(2, 0)
        assert ad.refuses_priority and seen == [1, None]
        ad.prewarm(Exchange(srv.endpoint), "m", [1, 2, 3], None, priority=1)
        assert seen == [1, None, None]  # not asked again
        other = _Server(_answer(json.dumps({"error": "no such model"}).encode(), status=400))
        try:  # a 400 for another reason is the server's error, not a refusal of the priority
            with pytest.raises(ServerError, match="no such model"):
                VLLMAdapter().prewarm(Exchange(other.endpoint), "m", [1], None, priority=1)
        finally:
            other.close()
    finally:
        srv.close()


def test_prewarm_chunks_end_on_whole_chunks_past_what_the_server_holds():
    from patchkv_agent.serving.middleware import PatchKVServerMiddleware, prewarm_ends

    assert prewarm_ends(0, 1300, 512) == [512, 1024, 1300]
    assert prewarm_ends(700, 1300, 512) == [1024, 1300]
    assert prewarm_ends(1024, 1100, 512) == [1100]
    assert prewarm_ends(0, 1024, 512) == [512, 1024]
    assert prewarm_ends(5, 9, None) == [9]
    for bad in ((10, 9, 512), (-1, 9, 512), (0, 9, 0)):
        with pytest.raises(ValueError):
            prewarm_ends(*bad)
    for kw in ({"chunk_tokens": -1}, {"chunk_tokens": 1.5}, {"priority": True}, {"priority": "low"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            PatchKVServerMiddleware(**kw)


def test_the_llamacpp_adapter_never_prewarms_a_salted_call():
    from patchkv_agent.serving.llamacpp import LlamaCppAdapter

    with pytest.raises(ServerError) as e:
        LlamaCppAdapter().prewarm(None, None, [1, 2], "tenant")
    assert e.value.kind == "unsupported"


def test_auto_detection_names_the_fix_for_an_unknown_server_and_bad_names_fail_early():
    other = _Server(_answer(b'{"hello": "world"}'))
    try:
        with pytest.raises(ServerError, match="name its adapter") as e:
            adapter_for("auto", other.endpoint)
        assert e.value.kind == "unknown"
    finally:
        other.close()
    with pytest.raises(ValueError, match="adapter must be one of"):
        adapter_for("sglang")
    with pytest.raises(ValueError, match="needs the server's endpoint"):
        adapter_for("auto")


def test_an_endpoint_is_the_models_own_address_and_key_and_refuses_header_injection():
    e = Endpoint.from_base_url("http://h:8000/v1/", api_key="sk-1", headers={"X-A": "b"}, model="m")
    assert e.root == "http://h:8000" and dict(e.headers) == {"Authorization": "Bearer sk-1", "X-A": "b"}
    assert dict(Endpoint.from_base_url("http://h/v1", api_key="EMPTY").headers) == {}
    for bad in ("ftp://h", "h:8000", "http://"):
        with pytest.raises(ValueError, match="http"):
            Endpoint(bad)
    with pytest.raises(ValueError, match="line break"):
        Endpoint.from_base_url("http://h/v1", api_key="k\r\nX-Evil: 1")


def test_the_payload_and_endpoint_come_from_the_agents_chat_model():
    pytest.importorskip("langchain_openai")
    from langchain.agents.middleware import ModelRequest
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    from patchkv_agent.serving.openai import chat_payload, endpoint_of, salt_of, with_salt

    @tool
    def search(query: str) -> str:
        """Search."""
        return query

    llm = ChatOpenAI(base_url="http://127.0.0.1:9/v1", api_key="sk-x", model="m", temperature=0, max_tokens=5,
                     default_headers={"X-Tenant": "a"})
    msgs = [SystemMessage("sys"), HumanMessage("hi"),
            AIMessage("", tool_calls=[{"name": "search", "args": {"query": "q"}, "id": "c1", "type": "tool_call"}]),
            ToolMessage("r", tool_call_id="c1")]
    req = ModelRequest(model=llm, messages=msgs[1:], system_message=msgs[0], tools=[search], tool_choice="auto",
                       state={"messages": msgs[1:]}, runtime=None)
    payload = chat_payload(req, msgs)
    bound = llm.bind_tools([search], tool_choice="auto")
    assert payload == bound.bound._get_request_payload(msgs, **bound.kwargs)  # what the agent's call sends
    assert payload["tools"][0]["function"]["name"] == "search" and payload["messages"][3]["tool_call_id"] == "c1"
    ep = endpoint_of(llm)
    assert ep.root == "http://127.0.0.1:9" and dict(ep.headers)["Authorization"] == "Bearer sk-x"
    assert dict(ep.headers)["X-Tenant"] == "a" and ep.model == "m"
    salted = with_salt(req, "t1")
    assert salt_of(chat_payload(salted, msgs)) == "t1" and salt_of(payload) is None
    with pytest.raises(ValueError, match="base_url"):
        endpoint_of(ChatOpenAI(api_key="k", model="m").model_copy(update={"openai_api_base": None}))


def test_server_call_stats_round_trip_and_refuse_other_json():
    st = ServerCallStats(server="vllm", thread="t", prepared="hit", prepared_tokens=300, cached_tokens=256,
                         prepared_info={"editors": ["X"]})
    js = st.to_json()
    assert js["kind"] == "server" and js["prepared"] == "hit" and "prepared_reason" not in js
    assert ServerCallStats.from_json(json.loads(json.dumps(js))) == st
    with pytest.raises(ValueError):
        ServerCallStats.from_json({"prepared": "hit"})
    with pytest.raises(ValueError):
        ServerCallStats(prepared="nearly")


# ------------------------------------------------------------------ the prediction's bounds


def _request(messages, editors_model=None):
    from langchain.agents.middleware import ModelRequest

    return ModelRequest(model=editors_model, messages=list(messages), system_message=SystemMessage("sys"), tools=[],
                        tool_choice=None, state={"messages": list(messages)}, runtime=None)


def test_a_10_mb_tool_result_and_a_100k_message_state_predict_within_bounds():
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware

    from patchkv_agent.langgraph.predict import MAX_PENDING_CHARS, PredictedRequest, placeholder_cap, predict_agent_request

    clear = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=50_000, keep=2)])
    assert placeholder_cap([clear]) == 2 * 4 * 50_000
    big = "x" * (10 << 20)
    hist = [HumanMessage("task")]
    for i in range(3):
        hist += [AIMessage("", tool_calls=[{"name": "fetch", "args": {}, "id": f"c{i}", "type": "tool_call"}]),
                 ToolMessage(big, tool_call_id=f"c{i}", name="fetch")]
    resp = AIMessage("", tool_calls=[{"name": "fetch", "args": {}, "id": f"k{j}", "type": "tool_call"} for j in range(8)])
    tracemalloc.start()
    pred = predict_agent_request(_request(hist), resp, [clear])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert isinstance(pred, PredictedRequest)
    sizes = pred.info["assumed_result_chars"]  # the median earlier result is 10 MiB
    assert len(sizes) == 8 and sum(sizes) <= MAX_PENDING_CHARS and max(sizes) == MAX_PENDING_CHARS // 8
    pending = [m for m in pred.messages if isinstance(m, ToolMessage) and pred.markers[0] in str(m.content)]
    assert len(pending) == 2 and all(len(m.content) <= MAX_PENDING_CHARS // 8 + 40 for m in pending)  # keep=2
    assert peak < 200 << 20  # the placeholders are bounded; the 64x "huge result" probe is capped too
    many = [HumanMessage("task")]
    for i in range(50_000):
        many += [AIMessage("", tool_calls=[{"name": "s", "args": {}, "id": f"c{i}", "type": "tool_call"}]),
                 ToolMessage("r", tool_call_id=f"c{i}", name="s")]
    t0 = time.monotonic()
    pred = predict_agent_request(_request(many), AIMessage("", tool_calls=[{"name": "s", "args": {}, "id": "z",
                                                                            "type": "tool_call"}]), [])
    assert isinstance(pred, PredictedRequest) and len(pred.messages) == len(many) + 3
    assert time.monotonic() - t0 < 120  # linear in the state (a generous bound on a loaded 2-core machine)


def test_prepared_calls_serve_each_thread_its_own_and_refuse_sampling():
    from patchkv_agent.langgraph.keys import using_thread_key
    from patchkv_agent.langgraph.predict import PreparedCalls, recording_calls
    from patchkv_agent.runtime.threads import thread_key

    cache = PreparedCalls()
    greedy = "[('temperature', 0.0)]"
    with using_thread_key(thread_key("a")), recording_calls():
        cache.lookup("p", greedy)
        cache.update("p", greedy, ["summary of a"])
    with using_thread_key(thread_key("b")):
        assert cache.lookup("p", greedy) is None  # thread b never sees a's prepared call
    with using_thread_key(thread_key("a")):
        assert cache.lookup("p", greedy) == ["summary of a"]
    for sampled in ("[('temperature', 0.7)]", '{"kwargs": {"model": "m"}}---[]', '{"kwargs": {"temperature": 1}}---[]'):
        with pytest.raises(ValueError, match="greedy calls only.*temperature=0"):
            cache.lookup("p", sampled)
    assert cache.lookup("p", '{"kwargs": {"temperature": 0}}---[]') is None


def test_a_real_call_waits_for_its_twin_no_longer_than_the_bound():
    from patchkv_agent.langgraph.predict import PreparedCalls, recording_calls

    cache = PreparedCalls(max_wait_s=0.5)
    started, release = threading.Event(), threading.Event()

    def twin():
        with recording_calls():
            cache.lookup("p", "m")
            started.set()
            release.wait(10)

    t = threading.Thread(target=twin)
    t.start()
    started.wait(5)
    t0 = time.monotonic()
    assert cache.lookup("p", "m") is None  # gave up: it decodes itself
    assert 0.3 < time.monotonic() - t0 < 3 and cache.gave_up == 1
    release.set()
    t.join(5)
    with pytest.raises(ValueError):
        PreparedCalls(max_wait_s=-1)


def test_the_server_bench_summary_splits_edited_and_append_calls_by_hand():
    from benchmarks.server_bench import _pair, summarize_server

    def row(mode, call, ttft, edited, prepared=None, cached=0, prompt=1000, ep="e"):
        return {"episode": ep, "workload": "clear", "mode": mode, "call": call, "ttft_s": ttft, "edited": edited,
                "prepared": prepared, "cached_tokens": cached, "prompt_tokens": prompt, "threads": 1,
                "episode_s": 10.0, "phase_s": 10.0, "action": {"text": f"a{call}", "tool_calls": []}}

    rows = [row("unprepared", 0, 1.0, None), row("unprepared", 1, 0.2, None, cached=900),
            row("unprepared", 2, 2.0, None, cached=128), row("unprepared", 3, 4.0, None, cached=0),
            row("prepared", 0, 1.0, False), row("prepared", 1, 0.22, False, "hit", cached=900),
            row("prepared", 2, 0.5, True, "hit", cached=896), row("prepared", 3, 2.0, True, "unfinished", cached=384)]
    rows[-1]["action"] = {"text": "other", "tool_calls": []}
    rows[-1]["tokens"], rows[3]["tokens"] = [("other", -0.6, 0.3)], [("a3", -0.5, 0.2)]  # parted at a 0.3-nat tie
    _pair(rows)
    s = summarize_server(rows)["by_threads"][1]
    assert s["predictable"] == 3 and s["outcomes"] == {"hit": 2, "unfinished": 1} and s["hit_rate"] == 2 / 3
    assert s["same_action"] == 3 / 4 and s["action_ties"] == 1 and s["same_action_or_tie"] == 1.0
    rows[-1]["tokens"] = [("other", -0.01, 4.0)]
    rows[3]["tokens"] = [("a3", -0.02, 3.5)]  # a clear decision each way: a different action, not a tie
    _pair(rows)
    assert summarize_server(rows)["by_threads"][1]["same_action_or_tie"] == 3 / 4
    e, a = s["kinds"]["edited"], s["kinds"]["append"]
    assert e["calls"] == 2 and e["ttft_median_unprepared_s"] == 3.0 and e["ttft_median_prepared_s"] == 1.25
    assert e["ttft_ratio"] == 1.25 / 3.0 and e["paired_ratio_median"] == (0.25 + 0.5) / 2
    assert a["calls"] == 1 and abs(a["ttft_ratio"] - 1.1) < 1e-9
    assert e["cached_share_prepared"] == (0.896 + 0.384) / 2 and e["cached_share_unprepared"] == 0.064
    assert s["throughput_calls_per_s"] == {"prepared": 0.4, "unprepared": 0.4}


def test_decoded_tokens_and_near_ties_read_the_servers_logprobs():
    meta = {"logprobs": {"content": [
        {"token": "A", "logprob": -0.1, "top_logprobs": [{"token": "A", "logprob": -0.1}, {"token": "B", "logprob": -2.6}]},
        {"token": "c", "logprob": -0.7, "top_logprobs": [{"token": "c", "logprob": -0.7}, {"token": "d", "logprob": -0.9}]},
        {"token": "x", "logprob": "junk"}]}}
    toks = decoded_tokens(meta)
    assert [t[0] for t in toks] == ["A", "c"] and toks[0][2] == pytest.approx(2.5) and toks[1][2] == pytest.approx(0.2)
    assert decoded_tokens({}) == [] and decoded_tokens({"logprobs": None}) == []
    other = [("A", -0.1, 2.5), ("d", -0.8, 0.1)]
    assert near_tie(toks, other, 0.5) is True        # parted where the margin was 0.2 (and 0.1)
    assert near_tie(toks, other, 0.05) is False
    assert near_tie(toks, toks, 0.5) is None          # the same tokens
    assert near_tie([("B", -0.3, 3.0)], toks, 1.0) is False  # parted where both led by 2.5+ nats
    assert near_tie(toks[:1], toks, 0.5) is True      # one stopped where the other's next token led by 0.2


def test_the_server_episodes_keep_what_they_are_told_and_refuse_a_bad_keep():
    from benchmarks.server_bench import server_episodes

    default = server_episodes(1, ["clear", "summarize"], context=5000)
    kept = server_episodes(1, ["clear", "summarize"], context=5000, keep=8)
    assert [e.setting[1] for e in kept] == [8, 16]
    assert [e.setting[0] for e in kept] == [e.setting[0] for e in default]  # the triggers stay the workloads'
    with pytest.raises(ValueError, match="keep"):
        server_episodes(1, ["clear"], keep=0)


def test_the_servers_look_for_their_engines_in_this_checkout():
    from pathlib import Path

    from benchmarks import servers

    assert (servers.ROOT / "pyproject.toml").is_file() and servers.ROOT == Path(__file__).resolve().parents[1]


def test_a_running_server_process_refuses_a_second_start():
    import sys

    from benchmarks.servers import ServerProcess

    code = ("import http.server as h; h.HTTPServer(('127.0.0.1', {port}), type('H', (h.BaseHTTPRequestHandler,), "
            "{'do_GET': lambda s: (s.send_response(200), s.end_headers())})).serve_forever()")
    srv = ServerProcess([sys.executable, "-c", code], name="toy", model="m", health="/", startup_s=30)
    try:
        first = srv.proc.pid
        with pytest.raises(RuntimeError, match="running already"):
            srv.start()
        assert srv.proc.pid == first and srv.proc.poll() is None  # the first process is still the one held
    finally:
        srv.stop()
    assert srv.proc is None

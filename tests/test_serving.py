"""The tool-wait prewarm on real serving engines: vLLM's CPU build and llama.cpp's server, each started once per
session on the embedded SmolLM2 (``scripts/serving_setup.sh`` sets them up; ``scripts/test.sh`` runs it).

Every model call is real. The agent's tool calls come from a script (SmolLM2's template renders no tools),
so a prepared run and an unprepared run of one episode send the same transcript; the oracle of a prepared
call is the same call unprepared on the same server (same next action), and of a fault the agent without
the middleware (same transcript).
"""

from __future__ import annotations

import threading
import uuid
import warnings

import pytest

from benchmarks.server_bench import ServerEpisode, near_tie, run_episode_agent
from serving_helpers import FAULTS, PREWARM_PATHS, FaultProxy, start_engine

pytestmark = pytest.mark.serving

SYSTEM = "You are a research assistant with a search tool. Answer with a short phrase."
TOPICS = ("the old bridge", "the river port", "the cathedral", "the market hall", "the town walls", "the mill",
          "the railway", "the harbour")


def _result(i: int) -> str:
    return (f"Passage {i} on {TOPICS[i % len(TOPICS)]}: " +
            "the river runs through the old town and past the market, where traders met each week. " * 5)[:470]


def episode(workload: str = "clear", calls: int = 7, setting: tuple = (600, 2, 0)) -> ServerEpisode:
    return ServerEpisode(id=f"test/{workload}", workload=workload, system=SYSTEM,
                         task="Which river runs through the old town? Search first.",
                         calls=tuple({"name": "search", "args": {"query": TOPICS[i % len(TOPICS)]}} for i in range(calls)),
                         results=tuple(_result(i) for i in range(calls)), setting=setting)


@pytest.fixture(scope="session")
def vllm_srv():
    srv = start_engine("vllm")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def llama_srv():
    srv = start_engine("llama.cpp")
    yield srv
    srv.stop()


@pytest.fixture(params=["vllm", "llama.cpp"])
def srv(request):
    return request.getfixturevalue("vllm_srv" if request.param == "vllm" else "llama_srv")


def _run(srv, url=None, **kw):
    """One episode run; llama.cpp's cache is emptied first (it has no salt to keep runs apart)."""
    srv.erase_cache()
    kw.setdefault("max_tokens", 4)
    kw.setdefault("tool_latency", 0.0)
    kw.setdefault("streaming", False)
    kw.setdefault("salt", srv.name == "vllm")
    return run_episode_agent(url or srv.base_url, srv.model, kw.pop("ep", None) or episode(), **kw)


def _transcript(run) -> list:
    return [(m.type, m.content, [(c["name"], c["args"]) for c in getattr(m, "tool_calls", None) or []])
            for m in run.messages]


BLOCK = {"vllm": 128, "llama.cpp": 1}  # the prefix cache's granularity (vLLM CPU: 128-token blocks)
# How far one engine's logits move when a prefix is computed in other batch splits (a prefix-cache hit, a
# prewarm, or a longer prefill), measured on the embedded model: vLLM's CPU build decodes the same tokens;
# llama.cpp's moves a token's logprob by up to ~0.35 nats and a top-two margin by up to ~0.6 (its prefix
# cache alone does so), so a greedy flip under 1 nat is the engine's rounding, not the prewarm's doing.
SPLIT_NOISE = {"vllm": {"logprob": 0.0, "tie": 0.0}, "llama.cpp": {"logprob": 0.5, "tie": 1.0}}


def _same_decisions(srv, prep, plain) -> None:
    """The prepared run decides what the unprepared one does, up to the engine's split noise: the same next
    actions (vLLM); on llama.cpp, every shared token's logprob within the noise, and a differing action
    only where the two runs parted at a near tie."""
    noise = SPLIT_NOISE[srv.name]
    for p, u in zip(prep.rows, plain.rows, strict=True):
        assert p["tokens"] and u["tokens"], "the server returned no logprobs"
        if not noise["tie"]:
            assert p["action"] == u["action"], (p["call"], p["action"], u["action"])
            continue
        for a, b in zip(p["tokens"], u["tokens"]):
            if a[0] != b[0]:
                break
            assert abs(a[1] - b[1]) <= noise["logprob"], (p["call"], a, b)
        if p["action"] != u["action"]:
            assert near_tie(p["tokens"], u["tokens"], noise["tie"]), (p["call"], p["tokens"], u["tokens"])


def test_prepared_edited_calls_hit_reuse_the_prewarm_and_act_as_unprepared(srv):
    nonce = uuid.uuid4().hex[:12]  # one context for both runs (vLLM keeps them apart by their salts)
    plain = _run(srv, prepare=False, nonce=nonce)
    prep = _run(srv, prepare=True, cover=True, nonce=nonce)
    if srv.name == "vllm":  # its own salt: the prepared run reuses nothing of the unprepared one's blocks
        assert prep.rows[0]["cached_tokens"] == 0, prep.rows[0]
    _same_decisions(srv, prep, plain)  # greedy, same server
    assert _transcript(prep) == _transcript(plain)
    assert {r["server"] for r in prep.rows[1:]} == {srv.name}  # the adapter was detected
    assert [r["prepared"] for r in prep.rows[1:]] == ["hit"] * (len(prep.rows) - 1), [
        (r["prepared"], r["prepared_reason"]) for r in prep.rows]
    edited = [i for i, r in enumerate(prep.rows) if r["edited"]]
    assert edited and all(prep.rows[i]["cleared"] for i in edited)
    b = BLOCK[srv.name]
    for i in edited:
        p, u = prep.rows[i], plain.rows[i]
        assert p["prompt_tokens"] == u["prompt_tokens"]
        assert p["cached_tokens"] >= (p["prepared_tokens"] // b) * b > u["cached_tokens"], (i, p, u)


def test_a_summary_written_during_the_wait_is_served_once_and_the_next_call_hits(vllm_srv):
    ep = episode("summarize", calls=7, setting=(700, 4))
    nonce = uuid.uuid4().hex[:12]
    prep = _run(vllm_srv, ep=ep, prepare=True, cover=True, nonce=nonce)
    mw = prep.middleware
    summarized = [r for r in prep.rows if r["summarized"]]
    assert summarized and mw.prepared_calls.hits == mw.prepared_calls.stored >= 1
    assert all(r["prepared"] == "hit" for r in summarized), [(r["prepared"], r["prepared_reason"]) for r in summarized]
    assert any("summary of the conversation" in str(m.content) for m in prep.messages)
    plain = _run(vllm_srv, ep=ep, prepare=False, nonce=nonce)
    assert _transcript(prep) == _transcript(plain)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_prewarm_leaves_the_agent_as_without_the_middleware(vllm_srv, fault):
    proxy = FaultProxy(vllm_srv.root, {p: fault for p in PREWARM_PATHS}, slow_s=5.0)
    try:
        nonce = uuid.uuid4().hex[:12]
        bare = _run(vllm_srv, url=proxy.base_url, middleware=False, nonce=nonce)
        hang = fault == "hang"
        run = _run(vllm_srv, url=proxy.base_url, prepare=True, cover=not hang, tool_latency=0.3 if hang else 0.0,
                   adapter="vllm", timeout_s=1.0, nonce=nonce)
        assert _transcript(run) == _transcript(bare)
        assert [r["action"] for r in run.rows] == [r["action"] for r in bare.rows]
        outcomes = {r["prepared"] for r in run.rows[1:]}
        assert outcomes == ({"unfinished"} if hang else {"failed"}), [(r["prepared"], r["prepared_reason"]) for r in run.rows]
        reasons = " ".join(r["prepared_reason"] for r in run.rows[1:])
        want = {"status500": "HTTP 500", "status404": "HTTP 404", "garbage": "not JSON", "nonobject": "not an object",
                "huge": "too_large", "huge_declared": "too_large", "close": "truncated", "slow": "timeout",
                "hang": "still rendering"}[fault]
        assert want in reasons, reasons
        if hang:  # the prewarm was aborted at the call, never waited for
            assert proxy.disconnects
    finally:
        proxy.close()


def test_prewarms_follow_each_replicas_url_and_key(vllm_srv):
    a, b = FaultProxy(vllm_srv.root), FaultProxy(vllm_srv.root)
    try:
        runs = {}

        def go(name, proxy):
            runs[name] = _run(vllm_srv, url=proxy.base_url, api_key=f"key-{name}", prepare=True, cover=True,
                              nonce=f"n{name}{uuid.uuid4().hex[:6]}")

        ts = [threading.Thread(target=go, args=(n, p)) for n, p in (("a", a), ("b", b))]
        [t.start() for t in ts]
        [t.join(600) for t in ts]
        for name, proxy in (("a", a), ("b", b)):
            warm = [r for r in proxy.requests() if r[0] in PREWARM_PATHS]
            assert warm and all(r[1].get("Authorization") == f"Bearer key-{name}" for r in warm)
            nonce = runs[name].nonce
            toks = [r for r in warm if r[0] == "/tokenize"]
            assert toks and all(nonce in r[2]["messages"][0]["content"] for r in toks)  # this thread's content only
            assert all(r[2].get("cache_salt") == f"run-{nonce}-prepared" for r in warm if r[0] == "/v1/completions")
            assert all(r["prepared"] == "hit" for r in runs[name].rows[1:])
    finally:
        a.close()
        b.close()


def test_a_long_prewarm_goes_out_in_low_priority_chunks_on_growing_prefixes(vllm_srv):
    proxy = FaultProxy(vllm_srv.root)
    try:
        run = _run(vllm_srv, url=proxy.base_url, prepare=True, cover=True, options={"chunk_tokens": 128})
        warm = [r[2] for r in proxy.requests("/v1/completions") if isinstance(r[2].get("prompt"), list)]
        sizes = [r["prewarm_requests"] or 0 for r in run.rows]  # one preparation at a time (the tools cover it)
        assert sum(sizes) == len(warm)
        prompts = [b["prompt"] for b in warm]
        groups = [prompts[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes)) if sizes[i]]
        for g in groups:  # one preparation's requests: each prompt extends the one before by a chunk at most,
            assert all(b[:len(a)] == a and 0 < len(b) - len(a) <= 128 for a, b in zip(g, g[1:]))
            assert all(len(p) % 128 == 0 for p in g[:-1]), [len(p) for p in g]  # ending on whole blocks
        assert any(len(g) > 1 for g in groups), [len(g) for g in groups]
        assert all(b.get("priority") == 1 for b in warm)  # below a call's 0
        rows = run.rows[1:]
        assert all(r["prepared"] == "hit" for r in rows), [(r["prepared"], r["prepared_reason"]) for r in rows]
    finally:
        proxy.close()


def test_a_salted_prewarm_is_reused_under_its_salt_only(vllm_srv):
    from patchkv_agent.serving.http import Endpoint, Exchange
    from patchkv_agent.serving.vllm import VLLMAdapter

    ad, ep = VLLMAdapter(), Endpoint.from_base_url(vllm_srv.base_url, model=vllm_srv.model)
    msgs = [{"role": "system", "content": f"{SYSTEM} {uuid.uuid4().hex}"}, {"role": "user", "content": _result(1) * 3}]
    ids = ad.render(Exchange(ep), {"messages": msgs})
    assert len(ids) > 256
    first = ad.prewarm(Exchange(ep), vllm_srv.model, ids, "tenant-a")
    assert first.cached_tokens == 0
    assert ad.prewarm(Exchange(ep), vllm_srv.model, ids, "tenant-b").cached_tokens == 0  # another tenant: nothing
    assert ad.prewarm(Exchange(ep), vllm_srv.model, ids, "tenant-a").cached_tokens >= 256


def test_forgotten_editors_warn_once_per_thread_naming_the_fix(vllm_srv):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = _run(vllm_srv, prepare=True, cover=True, give_editors=False)
    mine = [w for w in caught if "PatchKVServerMiddleware" in str(w.message)]
    assert len(mine) == 1 and "prepared_middleware" in str(mine[0].message)
    edited = [r for r in run.rows if r["prepared"] in ("miss", "partial")]
    assert edited and all("not among editors" in r["prepared_reason"] for r in edited)


def test_a_middleware_outside_the_editors_that_changes_tool_choice_is_named_and_judged_by_the_ids(vllm_srv):
    """The reason names the change; the outcome is what the server's ids say (SmolLM2's template renders no
    tools, so the prompt, and the prewarm's use, are the same)."""
    from langchain.agents.middleware import AgentMiddleware

    class ForceTool(AgentMiddleware):
        def __init__(self):
            super().__init__()
            self.n = 0

        def wrap_model_call(self, request, handler):
            self.n += 1
            return handler(request.override(tool_choice="auto") if self.n == 3 else request)

    run = _run(vllm_srv, prepare=True, cover=True, extra_middleware=[ForceTool()])
    r = run.rows[2]
    assert "tool_choice differs" in r["prepared_reason"] and r["prepared_match_tokens"] == r["prepared_tokens"], r
    assert r["prepared"] == "hit" and r["cached_tokens"] >= (r["prepared_tokens"] // 128) * 128
    # the next prediction starts from call 2's request (tool_choice="auto"), so call 3 differs back the same way
    assert "tool_choice differs" in run.rows[3]["prepared_reason"]
    assert all(x["prepared"] == "hit" and not x["prepared_reason"] for i, x in enumerate(run.rows[1:], 1) if i not in (2, 3))


def test_prepared_middleware_builds_the_editors_and_the_server_middleware_once(vllm_srv):
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware
    from langchain_openai import ChatOpenAI

    from patchkv_agent.langgraph import prepared_middleware
    from patchkv_agent.serving import PatchKVServerMiddleware

    llm = ChatOpenAI(base_url=vllm_srv.base_url, api_key="EMPTY", model=vllm_srv.model, temperature=0)
    clear = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=600, keep=2)])
    stack = prepared_middleware(llm, editors=[clear], cache_salt="t")
    assert stack[0] is clear and isinstance(stack[1], PatchKVServerMiddleware) and stack[1].editors == [clear]
    with pytest.raises(ValueError, match="PatchKVChatModel or a ChatOpenAI"):
        prepared_middleware(object(), editors=[clear])


def test_an_affinity_header_rides_on_every_call_and_its_prewarm(vllm_srv):
    """Behind a router with session affinity, the prewarm reaches the replica the call reaches."""
    import urllib.parse

    proxy = FaultProxy(vllm_srv.root)
    try:
        run = _run(vllm_srv, url=proxy.base_url, prepare=True, cover=True, options={"affinity_header": "x-session-id"})
        want = urllib.parse.quote(run.thread, safe="")
        calls = proxy.requests("/v1/chat/completions")
        warm = [r for r in proxy.requests() if r[0] in PREWARM_PATHS]
        assert calls and warm
        for path, headers, _ in calls + warm:
            assert {k.lower(): v for k, v in headers.items()}.get("x-session-id") == want, path
        assert all(r["prepared"] == "hit" for r in run.rows[1:])
    finally:
        proxy.close()

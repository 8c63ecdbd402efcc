"""A research agent whose controller edits its context in the middle, on PatchKV (LangGraph + local model).

For each HotpotQA question (packaged with patchkv-agent), one graph thread runs several turns:

1. ``controller``: turn 1 plans searches (one supporting passage, distractors up to ``--target-tokens``);
   later turns edit the middle of the context: replace a stale tool result with a fresh search
   (turn 2: the missing supporting passage; turn 3: a refreshed result), then compact two old
   exchanges into a summary (turn 4), as agent controllers do between turns.
2. ``tools``: runs the ``search`` tool over the question's own passages plus distractors (with a
   simulated latency, ``--tool-latency``) and asks the question again. Meanwhile the registry's worker
   offloads the model's KV of the previous turn (quantization, copies) in the background, for eviction
   and restarts; the next turn resumes from the resident KV without waiting for it.
3. ``llm`` (wrapped by :func:`patchkv_agent.langgraph.patchkv_node`): the model writes the answer,
   resuming the thread's previous context version with PatchKV. For comparison the same context is
   resumed on a shadow thread with ``prefix`` (Prefix Cache: recompute everything after the first
   edit), timed the same way.

The controller decides when the context is edited; the model chooses the searches of the edits itself
through real tool calls (``bind_tools([search], tool_choice="search")``: grammar-constrained, so a
135M model writes a valid call whose query it picks; the call and its result replace the stale pair in
the context), and writes every answer. ``--checkpointer sqlite:PATH`` keeps the graph's checkpoints in
SQLite; ``patchkv-agent replay --from-checkpointer sqlite:PATH`` replays them.
Per turn it prints TTFT and recompute tokens of PatchKV next to prefix recompute, where the resume's
base KV came from and how long it waited for an offload. ``--record PATH`` writes the run as replayable traces
(``patchkv-agent replay``).

    python examples/research_agent.py                      # SmolLM2-135M (embedded), 2 questions x 4 turns
    python examples/research_agent.py --model Qwen/Qwen2.5-0.5B-Instruct --questions 1
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from typing import Annotated, TypedDict

from langchain_core.messages import AIMessage, HumanMessage, RemoveMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from patchkv_agent.langgraph import PatchKVChatModel, PatchKVCheckpointSaver, TraceRecorder, patchkv_node
from patchkv_agent.langgraph.keys import current_thread_key
from patchkv_agent.eval.metrics import token_f1
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key
from patchkv_agent.eval.workloads import load_qa

SYSTEM = ("You are a research assistant with a `search` tool that returns one encyclopedia passage per call. "
          "Use the evidence to answer the user's question with a short phrase.")
EDITS = {2: "replace_tool_result", 3: "refresh_evidence", 4: "compact_history"}
PASSAGE_CHARS = 700


# ----------------------------------------------------------------------------------------- search tool

class PassageSearch:
    """Lexical search over one question's passages plus distractors from other questions."""

    def __init__(self, passages: list[dict]):
        self.passages = passages

    @staticmethod
    def _words(s: str) -> set[str]:
        return set(re.findall(r"[a-z0-9]+", s.lower()))

    def find(self, query: str, exclude: set[str] = frozenset()) -> dict:
        q = self._words(query)
        cands = [p for p in self.passages if p["title"] not in exclude] or self.passages
        return max(cands, key=lambda p: (p["title"].lower() == query.lower(), len(q & self._words(p["title"])),
                                          len(q & self._words(p["text"]))))


def render_passage(p: dict) -> str:
    text = p["text"] if len(p["text"]) <= PASSAGE_CHARS else p["text"][:PASSAGE_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"{p['title']}\n{text}"


def first_sentence(p: dict) -> str:
    s = re.split(r"(?<=[.!?])\s+", p["text"].strip())[0]
    return f"[{p['title']}] " + " ".join(s.split()[:16])


# ------------------------------------------------------------------------------------------ the graph

class AgentState(TypedDict, total=False):
    messages: Annotated[list, add_messages]
    turn: int
    pending: list[dict]       # searches the controller asked for: {"slot", "query"}
    slots: list[dict]         # exchanges in context: {"ai_id", "tool_id", "call_id", "title", "supporting"}
    log: Annotated[list, lambda a, b: a + b]


def build_graph(model: PatchKVChatModel, ex: dict, search: PassageSearch, args, rng: random.Random):
    registry = model.registry
    question = ex["input"]
    supporting = [p for p in ex["passages"] if p.get("is_supporting")]
    shown: set[str] = set()

    @tool("search")
    def search_tool(query: str) -> str:
        """Search the encyclopedia; returns one passage."""
        p = search.find(query, exclude=shown)
        shown.add(p["title"])
        return render_passage(p)

    def controller(state: AgentState) -> dict:
        turn = state.get("turn", 0) + 1
        slots = [dict(s) for s in state.get("slots", [])]
        if turn == 1:
            picks = [supporting[0]] + [p for p in search.passages if not p.get("is_supporting")]
            n_tok = len(model.render([SystemMessage(SYSTEM), HumanMessage(question)])[1]) + 40
            chosen = []
            for p in picks:
                cost = len(model.engine.encode(render_passage(p))) + 30
                if chosen and n_tok + cost > args.target_tokens:
                    continue
                chosen.append(p)
                n_tok += cost
            rng.shuffle(chosen)
            slots = [{"ai_id": f"ai{i}", "tool_id": f"tool{i}", "call_id": f"c{i}", "title": p["title"],
                      "supporting": bool(p.get("is_supporting"))} for i, p in enumerate(chosen)]
            pending = [{"slot": i, "query": s["title"]} for i, s in enumerate(slots)]
            return {"turn": turn, "slots": slots, "pending": pending,
                    "messages": [SystemMessage(SYSTEM, id="sys"),
                                 HumanMessage(f"Find evidence to answer: {question}", id="task")]}
        stale = [i for i, s in enumerate(slots) if not s["supporting"] and s.get("live", True)]
        if EDITS.get(turn) == "replace_tool_result" and stale:   # a stale result replaced: the model searches
            return {"turn": turn, "pending": [{"slot": stale[0], "query": None}]}
        if EDITS.get(turn) == "refresh_evidence" and stale:      # another stale result re-run by the model
            return {"turn": turn, "pending": [{"slot": stale[len(stale) // 2], "query": None}]}
        if len(stale) >= 2:                                          # compact two old exchanges
            a, b = slots[stale[0]], slots[stale[1]]
            by_title = {p["title"]: p for p in search.passages}
            summary = "Summary of earlier searches: " + " ".join(first_sentence(by_title[s["title"]]) for s in (a, b))
            a["live"] = b["live"] = False
            return {"turn": turn, "slots": slots, "pending": [], "messages": [
                AIMessage(summary, id=a["ai_id"]), RemoveMessage(id=a["tool_id"]),
                RemoveMessage(id=b["ai_id"]), RemoveMessage(id=b["tool_id"])]}
        return {"turn": turn, "pending": []}

    searcher = model.bind_tools([search_tool], tool_choice="search", max_tokens=args.search_tokens)

    def model_query(state: AgentState, slot: dict, thread_id: str) -> tuple[str, dict]:
        """The model's own tool call: it writes the search (grammar-forced to a valid call of `search`)."""
        keep = [m for m in state["messages"] if getattr(m, "id", None) not in (slot["ai_id"], slot["tool_id"])]
        ask = HumanMessage(f"The result for '{slot['title']}' is stale. Call the search tool to find better "
                           f"evidence for: {question}")
        ai = searcher.invoke(keep + [ask], {"configurable": {"thread_id": thread_id + "/search"}})
        if ai.tool_calls:
            return ai.tool_calls[0]["args"].get("query") or question, ai.response_metadata["patchkv"]
        print(f"      model's search call was invalid ({ai.invalid_tool_calls[:1]}); searching the question", flush=True)
        return question, ai.response_metadata["patchkv"]

    def tools(state: AgentState, config) -> dict:
        t0 = time.perf_counter()
        slots = [dict(s) for s in state["slots"]]
        out = []
        for req in state.get("pending", []):
            s = slots[req["slot"]]
            query = req["query"]
            if query is None:
                query, st = model_query(state, s, config["configurable"]["thread_id"])
                print(f"      model tool call: search(query={query!r})  [{st['strategy']}, "
                      f"{st['prompt_tokens']} ctx tok, TTFT {st['ttft_s']:.2f}s, grammar {st['grammar']}]", flush=True)
            result = search_tool.invoke({"query": query})
            s["title"] = result.split("\n", 1)[0]
            s["supporting"] = any(p["title"] == s["title"] for p in supporting)
            call = {"name": "search", "args": {"query": query}, "id": s["call_id"]}
            out += [AIMessage("", tool_calls=[call], id=s["ai_id"]),
                    ToolMessage(result, tool_call_id=s["call_id"], id=s["tool_id"])]
        time.sleep(max(0.0, args.tool_latency - (time.perf_counter() - t0)))  # the tool's latency (a floor)
        ask = HumanMessage(f"Question: {question} Answer in a few words.", id=f"q{state['turn']}")
        return {"messages": out + [ask], "slots": slots, "pending": [],
                "log": [{"tool_s": time.perf_counter() - t0}]}

    def llm(state: AgentState) -> dict:
        msgs = state["messages"]
        ai = model.invoke(msgs)
        st = dict(ai.response_metadata["patchkv"])
        key = current_thread_key()
        shadow = thread_key(key[0] + "/prefix", key[1])
        if state["turn"] == 1:
            registry.fork(key, shadow)   # both start from the same exact version 1
            ref = None
        else:
            ref = registry.generate(shadow, model.render(msgs)[1], strategy="prefix", max_new_tokens=1).stats.to_json()
        row = {"turn": state["turn"], "edit": EDITS.get(state["turn"], "initial" if state["turn"] == 1 else "append"),
               "patchkv": st, "prefix": ref, "answer": ai.content.strip(), "f1": token_f1(ai.content, ex["answers"]),
               "tool_s": (state.get("log") or [{}])[-1].get("tool_s")}
        print_row(row)
        return {"messages": [ai], "log": [row]}

    g = StateGraph(AgentState)
    g.add_node("controller", controller)
    g.add_node("tools", tools)
    g.add_node("llm", patchkv_node(llm, registry, offload="always"))
    g.add_edge(START, "controller")
    g.add_edge("controller", "tools")
    g.add_edge("tools", "llm")
    g.add_conditional_edges("llm", lambda s: "controller" if s["turn"] < args.turns else END)
    return g


# ------------------------------------------------------------------------------------------- report

def print_row(row: dict) -> None:
    st, ref = row["patchkv"], row["prefix"]
    line = (f"  turn {row['turn']} {row['edit']:<19} ctx {st['prompt_tokens']:>5} tok | {st['strategy']:<7} "
            f"TTFT {st['ttft_s']:6.3f}s recompute {st['recompute_tokens']:>5} "
            f"(P {st['prefix_tokens']}, X {st['new_tokens']}, S {st['suffix_tokens']}, restored {st['restore_tokens']})")
    if ref is not None:
        line += f" | prefix TTFT {ref['ttft_s']:6.3f}s recompute {ref['recompute_tokens']:>5}"
        line += f" | x{ref['ttft_s'] / max(st['ttft_s'], 1e-9):.1f}"
    if st.get("base") not in (None, "none"):
        line += f" | base {st['base']}, offload wait {st.get('offload_wait_s') or 0.0:.2f}s"
    print(line, flush=True)
    print(f"      answer: {row['answer'][:70]!r}  F1 {row['f1']:.2f}", flush=True)


def summary(rows: list[dict]) -> dict[str, float]:
    """Medians over turns >= 2 (turn 1 is an exact prefill for both)."""
    r = [x for x in rows if x["prefix"] is not None]
    if not r:
        return {}
    med = lambda xs: statistics.median(xs)  # noqa: E731
    return {
        "turns": len(r),
        "patchkv_ttft_s": med([x["patchkv"]["ttft_s"] for x in r]),
        "prefix_ttft_s": med([x["prefix"]["ttft_s"] for x in r]),
        "patchkv_recompute": med([x["patchkv"]["recompute_tokens"] for x in r]),
        "prefix_recompute": med([x["prefix"]["recompute_tokens"] for x in r]),
        "offload_wait_s": sum(x["patchkv"].get("offload_wait_s") or 0.0 for x in r),
        "resident_turns": sum(1 for x in r if x["patchkv"].get("base") == "resident"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="HF id, local dir, .gguf, or smollm2-135m")
    ap.add_argument("--questions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--target-tokens", type=int, default=1200, help="context size of turn 1")
    ap.add_argument("--tool-latency", type=float, default=1.5, help="simulated seconds per tool step")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--strategy", default="patchkv")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (0: torch's default). One thread each for the agent and the "
                         "offload worker fills 2 cores without oversubscription, and does not stall on busy cores")
    ap.add_argument("--record", default=None, help="write the run as traces (JSONL) here")
    ap.add_argument("--checkpointer", default="memory", metavar="memory|sqlite:PATH",
                    help="where the graph's checkpoints go (sqlite:PATH: replay them later with "
                         "`patchkv-agent replay --from-checkpointer sqlite:PATH`)")
    ap.add_argument("--search-tokens", type=int, default=48, help="token limit of the model's search calls")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from patchkv_agent import PatchKVEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = PatchKVEngine.from_pretrained(args.model)
    registry = ThreadRegistry(engine)
    model = PatchKVChatModel(registry=registry, strategy=args.strategy, max_new_tokens=args.max_new_tokens)
    if args.checkpointer == "memory":
        inner = InMemorySaver()
    elif args.checkpointer.startswith("sqlite:"):
        import sqlite3

        from langgraph.checkpoint.sqlite import SqliteSaver

        inner = SqliteSaver(sqlite3.connect(args.checkpointer[len("sqlite:"):], check_same_thread=False))
    else:
        ap.error(f"--checkpointer takes memory or sqlite:PATH, got {args.checkpointer!r}")
    saver = PatchKVCheckpointSaver(inner, registry)
    print(f"model {args.model} loaded in {time.perf_counter() - t0:.1f}s; block {engine.settings.block_size}, "
          f"{args.turns} turns x {args.questions} questions, tool latency {args.tool_latency}s", flush=True)

    rng = random.Random(args.seed)
    data = [ex for ex in load_qa("hotpotqa") if sum(bool(p.get("is_supporting")) for p in ex["passages"]) >= 2]
    others = [p for ex in data[args.questions:] for p in ex["passages"] if not p.get("is_supporting")]
    recorder = TraceRecorder(workload="research-agent", answers={ex["_id"]: ex["answers"] for ex in data})
    rows: list[dict] = []
    for ex in data[:args.questions]:
        print(f"\nQ {ex['_id']}: {ex['input']}  (gold: {ex['answers'][0]})", flush=True)
        pool = [p for p in ex["passages"]] + rng.sample(others, 10)
        app = build_graph(model, ex, PassageSearch(pool), args, rng).compile(checkpointer=saver)
        state = app.invoke({"turn": 0}, {"configurable": {"thread_id": ex["_id"]}, "callbacks": [recorder],
                                         "recursion_limit": 10 * args.turns})
        rows += [r for r in state["log"] if "patchkv" in r]

    s = summary(rows)
    if s:
        print(f"\nover {s['turns']} edited turns (medians): TTFT {args.strategy} {s['patchkv_ttft_s']:.3f}s vs "
              f"prefix {s['prefix_ttft_s']:.3f}s (x{s['prefix_ttft_s'] / max(s['patchkv_ttft_s'], 1e-9):.1f}); "
              f"recompute {s['patchkv_recompute']:.0f} vs {s['prefix_recompute']:.0f} tokens; "
              f"{s['resident_turns']}/{s['turns']} resumed from resident KV, {s['offload_wait_s']:.2f}s waited for "
              "offloads")
    if args.checkpointer != "memory":
        print(f"checkpoints in {args.checkpointer} (replay: patchkv-agent replay --from-checkpointer "
              f"{args.checkpointer} --strategies prefix,patchkv)")
    if args.record:
        n = recorder.write(args.record)
        print(f"wrote {n} traces to {args.record} (replay: patchkv-agent replay {args.record})")
    print(f"total {time.perf_counter() - t0:.1f}s")
    registry.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

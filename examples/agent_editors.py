"""The main job: a ``create_agent`` research agent whose context LangChain's own middlewares edit, on PatchKV.

One LangChain v1 agent (``create_agent``) over the embedded SmolLM2 with a ``search`` tool over the packaged
HotpotQA passages; its context is edited the way LangGraph users' agents edit theirs:

- ``ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger, keep)])``: past ``--clear-trigger`` tokens,
  every call sees all but the ``--clear-keep`` newest tool results replaced by ``[cleared]``;
- ``SummarizationMiddleware(model=llm, ...)``: past ``--summary-trigger`` tokens, the history before the last
  ``--summary-keep`` messages becomes one summary message, written by the same ``PatchKVChatModel`` (its
  calls run in their own context of the thread, never the agent's);
- ``PatchKVMiddleware(editors=[clear, summarize])``: when a response asks for a search, the next call's
  context up to the search result is predicted by those two middlewares' own code and computed exactly
  while the search runs (``--tool-latency`` seconds); the next call then computes only the result and what
  follows ("prepared during the tool wait"). A call the prediction missed resumes the thread's previous
  context (diff, plan, restore, recompute).

The model writes every search itself (grammar-forced ``search`` calls for the first ``--searches`` calls,
then ``tool_choice="auto"``). For each model call the demo prints the edit the middleware made, TTFT of
PatchKV, of prefix recompute and of the *no-edit floor* (the same call had the context not been edited:
the previous context served from cache, the appended messages computed), and whether PatchKV's next action
(the tool call and its arguments, or the text) equals exact's. The shadow runs (prefix, floor, exact) use
the same model and grammar on separate threads, after the agent's call.

    python examples/agent_editors.py                     # SmolLM2-135M, 1 question, 12 searches, 1.5 s tools
    python examples/agent_editors.py --questions 2 --tool-latency 0.5
    python examples/agent_editors.py --no-prepare        # without the tool-wait preparation
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parent))
from research_agent import PassageSearch, render_passage  # noqa: E402  (the demo's search tool)

from patchkv_agent.eval.workloads import load_qa, split_of  # noqa: E402
from patchkv_agent.langgraph import PatchKVChatModel, PatchKVMiddleware  # noqa: E402
from patchkv_agent.runtime.threads import thread_key  # noqa: E402

SYSTEM = ("You are a research assistant with a `search` tool that returns one encyclopedia passage per call. "
          "Search for evidence, then answer the user's question with a short phrase.")
SUMMARY_HEAD = "Here is a summary of the conversation to date"


class SearchArgs(BaseModel):
    """Arguments of ``search`` (a bounded query, so a forced call always closes within ``--max-tokens``)."""

    query: str = Field(description="what to look up", max_length=60)


def action_of(msg: AIMessage) -> tuple:
    """The next action of a response: its first tool call (name, arguments), else its text."""
    if msg.tool_calls:  # the canonical form of eval.metrics.next_action: name, arguments as sorted JSON
        c = msg.tool_calls[0]
        return ("call", str(c["name"]), json.dumps(c["args"], sort_keys=True))
    if msg.invalid_tool_calls:
        return ("invalid", str(msg.invalid_tool_calls[0].get("args")))
    return ("text", str(msg.content).strip())


def build_middlewares(llm: PatchKVChatModel, args, rows: list[dict]):
    from langchain.agents.middleware import (AgentMiddleware, ClearToolUsesEdit, ContextEditingMiddleware,
                                             SummarizationMiddleware)

    class SearchFirst(AgentMiddleware):
        """The first ``--searches`` calls must call ``search`` (grammar-forced); the next two choose
        (``auto``); then the tools are hidden and the model answers."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def wrap_model_call(self, request, handler):
            self.calls += 1
            if self.calls <= args.searches:
                request = request.override(tool_choice="search")
            elif self.calls > args.searches + 2:
                request = request.override(tool_choice="none")
            return handler(request)

    class Shadow(AgentMiddleware):
        """After each agent call: the same call under prefix and exact, and its no-edit floor (own threads)."""

        def __init__(self):
            super().__init__()
            self.prev_view: list | None = None
            self.prev_summary: str | None = None
            self.prev_cleared = 0

        def wrap_model_call(self, request, handler):
            from langgraph.config import get_config

            result = handler(request)
            ai = next(m for m in reversed(result.result) if isinstance(m, AIMessage))
            st = dict(ai.response_metadata.get("patchkv") or {})
            tid = str(get_config()["configurable"]["thread_id"])
            view = list(request.messages)
            msgs = ([request.system_message] if request.system_message else []) + view
            bound = llm.bind_tools(request.tools, tool_choice=request.tool_choice) if request.tools else llm
            # the edit the middlewares made, seen from what the model was given
            summary = view[0].content if view and SUMMARY_HEAD in str(view[0].content) else None
            cleared = sum(1 for m in view if getattr(m, "type", "") == "tool" and m.content == "[cleared]")
            if self.prev_view is None:
                edit = "first call"
            elif summary is not None and summary != self.prev_summary:
                edit = "summarized the history"
            elif cleared > self.prev_cleared:
                edit = f"cleared {cleared - self.prev_cleared} tool result(s) ({cleared} in all)"
            else:
                edit = "append"
            # two shadow threads hold the previous call's exact KV: one prices the floor, one prefix recompute
            # (whose greedy output is exact's); then the floor thread takes the prefix thread's new state
            reg = llm.registry
            pre_key, floor_key = thread_key(f"{tid}/prefix"), thread_key(f"{tid}/floor")
            floor = None
            if self.prev_view is not None:
                last_ai = max(i for i, m in enumerate(view) if isinstance(m, AIMessage))
                unedited = self.prev_view + view[last_ai:]
                floor = bound.invoke(unedited, {"configurable": {"thread_id": floor_key[0]}}, strategy="prefix",
                                     max_tokens=0).response_metadata["patchkv"]
            ref = bound.invoke(msgs, {"configurable": {"thread_id": pre_key[0]}},
                               strategy="prefix" if self.prev_view is not None else "exact")
            reg.fork(reg.active(pre_key), floor_key)
            rst = ref.response_metadata["patchkv"]
            row = {"call": len(rows) + 1, "edit": edit, "tokens": st.get("prompt_tokens"),
                   "patchkv_s": st.get("ttft_s"), "prefix_s": rst.get("ttft_s"),
                   "floor_s": floor.get("ttft_s") if floor else None,
                   "same_action": action_of(ai) == action_of(ref), "action": action_of(ai),
                   "exact_action": action_of(ref), "recompute": st.get("recompute_tokens"),
                   "prefix_recompute": rst.get("recompute_tokens"), "base": st.get("base"),
                   "strategy": st.get("strategy"), "fallback": st.get("fallback"),
                   "healed": st.get("base_healed_rows"), "heal_wait_s": st.get("heal_wait_s") or 0.0,
                   "context": st.get("context"), "prepared": st.get("prepared"),
                   "prepared_reason": st.get("prepared_reason"),
                   "hidden": st.get("prepared_hidden_share")}
            rows.append(row)
            print_row(row)
            self.prev_view, self.prev_summary, self.prev_cleared = msgs, summary, cleared
            return result

    clear = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=args.clear_trigger, keep=args.clear_keep)],
                                     token_count_method="model")
    summarize = SummarizationMiddleware(model=llm, trigger=("tokens", args.summary_trigger),
                                        keep=("messages", args.summary_keep),
                                        token_counter=llm.get_num_tokens_from_messages)
    return [SearchFirst(), clear, summarize, Shadow(),
            PatchKVMiddleware(llm.registry, editors=[clear, summarize], prepare=not args.no_prepare)]


def print_row(r: dict) -> None:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:7.0f}"

    act = r["action"]
    what = f"{act[1]}({act[2][:40]})" if act[0] == "call" else repr(str(act[-1])[:40])
    heal = (f", base healed ({r['healed']} rows, waited {r['heal_wait_s'] * 1e3:.0f} ms)"
            if r.get("healed") else "")
    if r.get("prepared") == "hit":
        heal += ", prepared during the tool wait"
    elif r.get("prepared"):
        heal += f", preparation {r['prepared']}: {str(r.get('prepared_reason') or '')[:70]}"
    print(f"  call {r['call']:2d} {r['tokens'] or 0:5d} tok  {r['edit']:<44} TTFT ms patchkv {ms(r['patchkv_s'])} "
          f"prefix {ms(r['prefix_s'])} floor {ms(r['floor_s'])}  next action "
          f"{'== exact' if r['same_action'] else '!= exact'}: {what}  [{r['strategy']}, recompute "
          f"{r['recompute']} vs {r['prefix_recompute']}{heal}]", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--questions", type=int, default=1)
    ap.add_argument("--searches", type=int, default=12, help="forced search calls before the model may answer")
    ap.add_argument("--clear-trigger", type=int, default=1800)
    ap.add_argument("--clear-keep", type=int, default=3)
    ap.add_argument("--summary-trigger", type=int, default=2400)
    ap.add_argument("--summary-keep", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96,
                    help="tokens per model call (room for a whole search call: the next action)")
    ap.add_argument("--tool-latency", type=float, default=1.5,
                    help="seconds each search takes (simulated; real searches and shell tools take 0.5-30 s)")
    ap.add_argument("--no-prepare", action="store_true",
                    help="do not prepare the next call's context while the search runs")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args(argv)
    for name in ("questions", "searches", "clear_trigger", "summary_trigger", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.clear_keep < 0 or args.summary_keep < 1 or args.tool_latency < 0:
        ap.error("--clear-keep >= 0, --summary-keep >= 1 and --tool-latency >= 0 are required")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from langchain.agents import create_agent

    print(f"loading {args.model} ...", flush=True)
    llm = PatchKVChatModel.from_pretrained(args.model, max_tokens=args.max_tokens)
    data = [ex for ex in load_qa("hotpotqa") if split_of(ex["_id"]) == "eval"]
    rows: list[dict] = []
    for q in range(args.questions):
        ex = data[q]
        pool = list(ex["passages"]) + [p for other in data[q + 1:q + 6] for p in other["passages"]]
        search, shown = PassageSearch(pool), set()

        @tool("search", args_schema=SearchArgs)
        def search_tool(query: str) -> str:
            """Search the encyclopedia; returns one passage."""
            time.sleep(args.tool_latency)
            p = search.find(query, exclude=shown)
            shown.add(p["title"])
            return render_passage(p)

        agent = create_agent(llm, tools=[search_tool], system_prompt=SYSTEM,
                             middleware=build_middlewares(llm, args, rows))
        print(f"\nquestion {q + 1}: {ex['input']}", flush=True)
        agent.invoke({"messages": [HumanMessage(f"Find evidence with the search tool to answer this question: "
                                                f"{ex['input']}")]},
                     {"configurable": {"thread_id": f"q{q}"}, "recursion_limit": 4 * args.searches + 20})
    resumed = [r for r in rows if r["edit"] != "first call"]
    if resumed:
        print_summary(resumed, args)
    return 0


def print_summary(resumed: list[dict], args) -> None:
    """Edited and append-only calls apart (on appended calls every strategy is alike; the edited ones are where
    the strategies differ): count, median TTFT of PatchKV / prefix / floor, the prepared outcomes, the next
    action against exact's."""
    def med(rs, k):
        vals = [r[k] for r in rs if r.get(k)]
        return statistics.median(vals) * 1e3 if vals else float("nan")

    print()
    for kind, rs in (("edited by a middleware", [r for r in resumed if r["edit"] != "append"]),
                     ("append-only", [r for r in resumed if r["edit"] == "append"])):
        if not rs:
            print(f"{kind}: no calls")
            continue
        outcomes = Counter(str(r.get("prepared") or "not prepared") for r in rs)
        ratio = med(rs, "patchkv_s") / med(rs, "prefix_s")
        print(f"{kind}: {len(rs)} calls, median TTFT patchkv {med(rs, 'patchkv_s'):.0f} ms, prefix "
              f"{med(rs, 'prefix_s'):.0f} ms ({ratio:.2f}x), no-edit floor {med(rs, 'floor_s'):.0f} ms; next action "
              f"equal to exact's in {sum(r['same_action'] for r in rs)}/{len(rs)}; prepared: "
              + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
              + f"; {sum(1 for r in rs if r['fallback'])} exact fallbacks")
    slower = [r for r in resumed if r.get("patchkv_s") and r.get("prefix_s") and r["patchkv_s"] > r["prefix_s"]]
    print(f"calls slower than prefix: {len(slower)}/{len(resumed)}"
          + "".join(f"; call {r['call']} ({r['edit']}, prepared {r.get('prepared')}) {r['patchkv_s'] * 1e3:.0f} vs "
                    f"{r['prefix_s'] * 1e3:.0f} ms" for r in slower[:4]))
    if not args.no_prepare:
        misses = sorted({f"{r.get('prepared')} ({str(r.get('prepared_reason'))[:60]})" for r in resumed
                         if r.get("prepared") not in ("hit", None)})
        print(f"prepared during the {args.tool_latency:.1f} s tool wait: "
              f"{sum(1 for r in resumed if r.get('prepared') == 'hit')}/{len(resumed)} resumed calls; other outcomes: "
              + (", ".join(misses) or "none"))
    heal = statistics.median(r["heal_wait_s"] for r in resumed) * 1e3
    print(f"median wait for the base's heal {heal:.0f} ms (the heal runs while the tool runs; on this CPU it can "
          f"outlast a {args.tool_latency:.1f} s tool)")


if __name__ == "__main__":
    raise SystemExit(main())

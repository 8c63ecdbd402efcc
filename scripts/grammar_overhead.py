"""Constrained-decoding overhead, side by side in one run: the same resumed context decoded with and
without the grammar (alternating, so machine noise hits both alike).

    .venv/bin/python scripts/grammar_overhead.py [--model smollm2-135m] [--reps 5] [--tokens 32] [--out FILE.json]

Reports, per grammar kind (auto tool calls, a forced call, a JSON schema): median per-token decode time
(ms) with and without the grammar, the median mask time per token, and median first-token latency
(resume + first token choice) with and without; plus the grammar's one-time compile time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["answer", "confidence"]}


def main() -> None:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool

    from patchkv_agent.core.sampling import Sampler
    from patchkv_agent.langgraph import PatchKVChatModel
    from patchkv_agent.langgraph.chat_model import grammar_compiler
    from patchkv_agent.langgraph.grammar import spec_for
    from patchkv_agent.langgraph.tools import tool_schemas

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    @tool
    def search(query: str, max_results: int = 3) -> str:
        """Search the encyclopedia; returns passages."""
        return query

    llm = PatchKVChatModel.from_pretrained(args.model)
    eng, reg = llm.engine, llm.registry
    tools = tool_schemas([search])
    msgs = [SystemMessage("You are a research assistant."),
            HumanMessage("Where is the Eiffel Tower, and how tall is it? Search if you need to.")]
    t0 = time.perf_counter()
    gc = grammar_compiler(eng)
    info_s = time.perf_counter() - t0
    kinds = {"auto_calls": (tools, spec_for(tools=tools)), "forced_call": (tools, spec_for(tools=tools, tool_choice="any")),
             "json_schema": (None, spec_for(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}))}
    report = {"model": args.model, "tokens": args.tokens, "reps": args.reps, "tokenizer_info_s": info_s, "kinds": {}}
    for kind, (tl, spec) in kinds.items():
        ids = llm.render(msgs, tl, None if tl else {"type": "json_schema", "json_schema": {"schema": SCHEMA}})[1]
        t0 = time.perf_counter()
        gc.processor(spec)
        compile_s = time.perf_counter() - t0
        rows = {True: [], False: []}
        for rep in range(args.reps):
            for grammar in ((True, False) if rep % 2 else (False, True)):
                proc = gc.processor(spec) if grammar else None
                t0 = time.perf_counter()
                s = reg.stream(None, ids, strategy="exact", max_new_tokens=args.tokens, sampler=Sampler(processor=proc))
                it = iter(s)
                next(it)
                first = time.perf_counter() - t0
                for _ in it:
                    pass
                n = len(s.result.output_ids)
                rows[grammar].append({"first_token_s": first, "per_token_ms": 1e3 * s.stats["decode_s"] / max(1, n - 1),
                                      "mask_ms": 1e3 * proc.mask_s / max(1, proc.steps) if proc else 0.0, "n": n})
        med = lambda g, k: statistics.median(r[k] for r in rows[g])  # noqa: E731
        report["kinds"][kind] = {
            "compile_s": compile_s,
            "per_token_ms": {"grammar": med(True, "per_token_ms"), "none": med(False, "per_token_ms")},
            "mask_ms_per_token": med(True, "mask_ms"),
            "first_token_s": {"grammar": med(True, "first_token_s"), "none": med(False, "first_token_s")},
            "tokens_decoded": {"grammar": med(True, "n"), "none": med(False, "n")},
        }
        print(json.dumps({kind: report["kinds"][kind]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    reg.close()


if __name__ == "__main__":
    main()

"""Measure the two maintained structured-generation libraries on this CPU, on the embedded model's
tokenizer: grammar compile time for a tool-call schema, and the per-token cost of computing the
allowed-token mask, applying it to the logits and advancing the matcher along a schema-valid call.

    .venv/bin/python scripts/grammar_backends.py [--model smollm2-135m] [--reps 5]

Prints one JSON line per backend (medians over ``--reps`` walks). patchkv-agent uses the faster one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "query": {"type": "string", "description": "what to search for"},
    "max_results": {"type": "integer", "minimum": 1}}, "required": ["query"]}
CALL = '<tool_call>{"name": "search", "arguments": {"query": "Eiffel Tower height in metres", "max_results": 3}}</tool_call>'


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    from patchkv_agent.loading import EMBEDDED_MODELS, ensure_embedded

    if name in EMBEDDED_MODELS:
        p = ensure_embedded(name)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(name)


def bench_xgrammar(tok, vocab: int, ids: list[int], reps: int) -> dict:
    import xgrammar as xgr
    from xgrammar.structural_tag import JSONSchemaFormat, StructuralTag, TagFormat

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    t1 = time.perf_counter()
    tag = StructuralTag(format=TagFormat(begin='<tool_call>{"name": "search", "arguments": ',
                                         content=JSONSchemaFormat(json_schema=SCHEMA), end="}</tool_call>"))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    cg = compiler.compile_structural_tag(tag)
    t2 = time.perf_counter()
    steps = []
    for _ in range(reps):
        m = xgr.GrammarMatcher(cg)
        mask = xgr.allocate_token_bitmask(1, vocab)
        logits = torch.randn(vocab)
        for t in ids:
            s = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            assert m.accept_token(t)
            steps.append(time.perf_counter() - s)
        assert m.is_completed() or m.accept_string("") is not False
    return {"backend": "xgrammar", "tokenizer_info_s": t1 - t0, "compile_s": t2 - t1,
            "per_token_ms": 1e3 * statistics.median(steps), "p90_ms": 1e3 * sorted(steps)[int(0.9 * len(steps))]}


def bench_llguidance(tok, vocab: int, ids: list[int], reps: int) -> dict:
    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    lark = ('start: "<tool_call>{\\"name\\": \\"search\\", \\"arguments\\": " args "}</tool_call>"\n'
            f"args: %json{json.dumps(SCHEMA)}\n")
    grm = llguidance.LLMatcher.grammar_from_lark(lark)
    m0 = llguidance.LLMatcher(lltok, grm)
    assert not m0.is_error(), m0.get_error()
    t2 = time.perf_counter()
    steps = []
    for _ in range(reps):
        m = llguidance.LLMatcher(lltok, grm)
        logits = torch.randn(vocab)
        for t in ids:
            s = time.perf_counter()
            bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
            allowed = ((bits.repeat_interleave(32) >> torch.arange(32, dtype=torch.int32).repeat(bits.numel())) & 1)[:vocab]
            logits.masked_fill_(allowed == 0, float("-inf"))
            assert m.consume_token(t), m.get_error()
            steps.append(time.perf_counter() - s)
    return {"backend": "llguidance", "tokenizer_info_s": t1 - t0, "compile_s": t2 - t1,
            "per_token_ms": 1e3 * statistics.median(steps), "p90_ms": 1e3 * sorted(steps)[int(0.9 * len(steps))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(args.model)
    vocab = len(tok)
    ids = tok(CALL, add_special_tokens=False)["input_ids"]
    print(json.dumps({"model": args.model, "vocab": vocab, "call_tokens": len(ids)}))
    for fn in (bench_xgrammar, bench_llguidance):
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in fn(tok, vocab, ids, args.reps).items()}),
              flush=True)


if __name__ == "__main__":
    main()

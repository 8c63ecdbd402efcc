"""The summary of one scripts/gpu_check.sh folder: ``summary.md`` (tables) and ``summary.json``.

    python scripts/gpu_check_summary.py DIR

Reads what the stages left (``stages.jsonl``, ``env.json``, ``kernels.json``, ``resume_*.json``,
``host_*/host.json``, ``prepare_contention.json``, ``logs/*.log``); a stage that failed or left nothing is
listed with its exit status and the last lines of its log. Never raises on a missing or partial file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABEL = "random weights, timing only"
ORDER = ("exact", "prefix", "patchkv", "cacheblend", "direct")


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except Exception:  # noqa: BLE001 - missing, partial or not JSON: the stage table says why
        return None


def _f(v, spec=".2f", none="-"):
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "NO"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def _tail(path: Path, n: int = 12) -> str:
    try:
        lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    except OSError:
        return ""
    lines = [ln for ln in lines if ln.strip()]
    return "\n".join(ln[:300] for ln in lines[-n:])


def summarize(d: Path) -> tuple[str, dict]:
    md: list[str] = []
    js: dict = {"folder": str(d)}
    stages = []
    if (d / "stages.jsonl").is_file():
        for ln in (d / "stages.jsonl").read_text().splitlines():
            try:
                stages.append(json.loads(ln))
            except ValueError:
                pass
    js["stages"] = stages
    env = _load(d / "env.json") or {}
    js["env"] = {k: env.get(k) for k in ("gpu", "gpu_mem_gib", "python", "torch", "torch_cuda", "transformers",
                                         "triton", "triton_ok", "triton_error", "kernel_backend", "native_available",
                                         "native_status", "bench_imports_optional", "random_tokenizer",
                                         "random_tokenizer_error", "import_error", "cpus")}
    md += ["# gpu_check summary", "",
           f"Models built from configs with **{LABEL}** (`random:<shape>@bf16`: SmolLM2-135M's shape and "
           "Llama-3.2-1B's); recompute counts follow random attention statistics and are indicative only.", "",
           f"GPU: {env.get('gpu')} ({_f(env.get('gpu_mem_gib'), '.0f')} GiB); python {env.get('python')}, torch "
           f"{env.get('torch')} (CUDA {env.get('torch_cuda')}), transformers {env.get('transformers')}, triton "
           f"{env.get('triton')}; Triton smoke kernel: {_f(env.get('triton_ok'))}; kernel backend of the stages: "
           f"{next((s.get('kernels') for s in stages if s.get('name') != 'env' and s.get('kernels')), None) or env.get('kernel_backend')}; native CPU kernels: "
           f"{env.get('native_status')}; optional packages the benchmark paths imported: "
           f"{env.get('bench_imports_optional')}", ""]
    if env.get("triton_error"):
        md += ["Triton smoke error: `" + str(env["triton_error"])[:300] + "`", ""]
    md += ["## Stages", ""]
    rows = []
    for s in stages:
        state = "ok" if s.get("rc") == 0 else ("skipped" if s.get("skipped") else
                                               "TIMEOUT" if s.get("rc") in (124, 137) else "FAILED")
        rows.append([s.get("name"), state, s.get("rc"), _f(s.get("wall_s"), ".1f"), s.get("timeout_s")])
    md += _table(["stage", "state", "rc", "wall s", "timeout s"], rows)
    for s in stages:
        if s.get("rc") not in (0, None) and not s.get("skipped"):
            tail = _tail(d / "logs" / f"{s.get('name')}.log")
            s["log_tail"] = tail
            md += [f"`{s.get('name')}` (rc {s.get('rc')}), last lines:", "", "```", tail, "```", ""]

    kern = _load(d / "kernels.json")
    if kern:
        js["kernels"] = {"ok": kern.get("ok"), "device": kern.get("device"), "shapes": []}
        md += ["## Triton kernels vs torch references", "",
               f"device {kern.get('device')}; all agree: {_f(kern.get('ok'))}", ""]
        rows = []
        for sh in kern.get("shapes") or [{k: kern.get(k) for k in ("heads", "rows", "head_dim", "formats")}]:
            shape = f"{sh.get('heads')}x{sh.get('rows')}x{sh.get('head_dim')}"
            js["kernels"]["shapes"].append({"shape": shape, "formats": sh.get("formats")})
            for tag, r in (sh.get("formats") or {}).items():
                rows.append([shape, tag, _f(r.get("quantize_bit_exact")), _f(r.get("scatter_max_abs_err"), ".1e"),
                             _f(r.get("bf16_scatter_max_rel_err"), ".1e"), _f(r.get("quantize_ms"), ".3f"),
                             _f(r.get("ref_quantize_ms"), ".3f"), _f(r.get("restore_ms"), ".3f"),
                             _f(r.get("ref_restore_ms"), ".3f"), _f(r.get("memcpy_ms"), ".3f"),
                             _f(r.get("restore_vs_memcpy"), ".0%")])
        md += _table(["heads x rows x dim", "format", "quantize bit-exact", "scatter max abs err",
                      "bf16 scatter max rel err", "quantize ms", "ref quantize ms", "restore ms", "ref restore ms",
                      "memcpy ms", "restore at % of memcpy"], rows)

    js["resume"] = {}
    resumes = sorted(d.glob("resume_*.json"))
    if resumes:
        md += ["## Resume TTFT per strategy (" + LABEL + ")", "",
               "wall: the `engine.resume` call to the first token (max_new_tokens=0), device synchronised, median "
               "over the repeats after warm-up; ttft: the engine's restore + forward to the first token; plan: its "
               "host-side diff + plan (CPU); x prefix: prefix's median wall over this strategy's.", ""]
    for path in resumes:
        r = _load(path)
        if not r:
            md += [f"`{path.name}`: unreadable", ""]
            continue
        name = r.get("model")
        js["resume"][name] = {"label": r.get("label"), "dtype": r.get("dtype"), "profile": r.get("profile"),
                              "block_size": r.get("block_size"), "errors": r.get("errors"),
                              "skipped": r.get("skipped"), "checkpoints": r.get("checkpoints"), "by_tokens": {}}
        md += [f"### {name} ({r.get('label')}; {r.get('dtype')}, {r.get('layers')} layers x {r.get('kv_heads')} KV "
               f"heads x {r.get('head_dim')}; profile {Path(str(r.get('profile'))).name}, block {r.get('block_size')}; "
               f"edit {r.get('edit_tokens')} ids at {r.get('depth')}, +{r.get('append')} appended; "
               f"n={r.get('repeats')})", ""]
        rows = []
        for row in sorted(r.get("rows") or [], key=lambda x: (x.get("context_tokens", 0),
                                                              ORDER.index(x["strategy"]) if x.get("strategy") in ORDER
                                                              else 99)):
            js["resume"][name]["by_tokens"].setdefault(str(row.get("context_tokens")), {})[row.get("strategy")] = {
                k: row.get(k) for k in ("wall_ms", "ttft_ms", "host_plan_ms", "restore_ms", "recompute_ms",
                                        "recompute_tokens", "restore_tokens", "payload_bytes", "vs_prefix",
                                        "ttft_vs_prefix", "fallbacks", "restore_kernel")}
            rows.append([row.get("context_tokens"), row.get("strategy"), _f(row.get("wall_ms")),
                         _f(row.get("ttft_ms")), _f(row.get("host_plan_ms")), row.get("recompute_tokens"),
                         row.get("restore_tokens"), _f((row.get("payload_bytes") or 0) / 2**20, ".1f"),
                         _f(row.get("vs_prefix"), ".2f") + "x", ",".join(row.get("fallbacks") or []) or "-"])
        md += _table(["context", "strategy", "wall ms", "ttft ms", "plan ms (host)", "recompute", "restored",
                      "payload MiB", "x prefix", "fallbacks"], rows)
        ck = r.get("checkpoints") or []
        if ck:
            md += ["checkpoint pass: " + ", ".join(f"{c.get('tokens')} tok {_f(c.get('checkpoint_ms'), '.0f')} ms "
                                                    f"(prefill {_f(c.get('prefill_ms'), '.0f')}, offload "
                                                    f"{_f(c.get('offload_ms'), '.0f')})" for c in ck), ""]
        for e in r.get("errors") or []:
            md += [f"- error: {e}"]
        for e in r.get("skipped") or []:
            md += [f"- skipped: {e}"]
        if r.get("errors") or r.get("skipped"):
            md.append("")

    js["host"] = {}
    for path in sorted(d.glob("host_*/host.json")):
        h = _load(path)
        if not h:
            continue
        key = path.parent.name
        js["host"][key] = {"model": h.get("model"), "device": h.get("device"), "dtype": h.get("dtype"),
                           "random_weights": h.get("random_weights"), "targets_ms": h.get("targets_ms"),
                           "rows": [{k: r.get(k) for k in ("tokens", "edits", "host_ms", "plan_ms", "diff_ms",
                                                           "kv_copy_ms", "kv_copy_fp_ms", "memcpy_ms",
                                                           "kv_copy_fp_vs_memcpy", "restore_kernel", "reader_scan")}
                                    for r in h.get("rows") or []],
                           "tokenize": h.get("tokenize")}
        md += [f"## bench-host `{key}`: {h.get('model')} on {h.get('device')} ({h.get('dtype')}"
               f"{', ' + LABEL if h.get('random_weights') else ''}; {h.get('layers')} layers x {h.get('kv_heads')} KV "
               f"heads; targets {h.get('targets_ms')} ms for 1 edit)", ""]
        rows = [[r.get("tokens"), r.get("edits"), _f(r.get("host_ms")), _f(r.get("diff_ms")), _f(r.get("plan_ms")),
                 _f(r.get("kv_copy_ms")), _f(r.get("kv_copy_fp_ms")), _f(r.get("memcpy_ms")),
                 _f(r.get("kv_copy_fp_vs_memcpy"), ".2f"), r.get("restore_kernel"), r.get("reader_scan")]
                for r in h.get("rows") or []]
        md += _table(["tokens", "edits", "host ms (median)", "diff ms", "plan ms", "kv copy ms (mixed)",
                      "kv copy ms (fp)", "memcpy ms", "fp / memcpy", "restore kernel", "reader scan"], rows)
        if h.get("tokenize"):
            md += _table(["tokens", "template ms", "tokenize whole ms", "tokenize memo ms"],
                         [[t.get("tokens"), _f(t.get("template_ms")), _f(t.get("tokenize_whole_ms")),
                           _f(t.get("tokenize_memo_ms"))] for t in h["tokenize"]])

    prep = _load(d / "prepare_contention.json")
    if prep:
        js["prepare_contention"] = prep
        md += [f"## Foreground resume while another thread is prepared ({prep.get('model')}, {prep.get('label')}, "
               f"{prep.get('dtype')}, {prep.get('device')})", ""]
        md += _table(["context", "chunk", "B resume alone ms (median / max)", "B during preparation ms (median / max)",
                      "B delay ms", "delay in chunks", "chunk forward ms", "A prep alone s", "A prep under B s"],
                     [[prep.get("tokens"), prep.get("chunk"),
                       f"{_f((prep.get('b_resume_alone_s') or {}).get('median', 0) * 1e3)} / "
                       f"{_f((prep.get('b_resume_alone_s') or {}).get('max', 0) * 1e3)}",
                       f"{_f((prep.get('b_resume_during_preparation_s') or {}).get('median', 0) * 1e3)} / "
                       f"{_f((prep.get('b_resume_during_preparation_s') or {}).get('max', 0) * 1e3)}",
                       _f((prep.get("b_delay_median_s") or 0) * 1e3), _f(prep.get("b_delay_in_chunks")),
                       _f((prep.get("background_chunk_forward_s") or 0) * 1e3), _f(prep.get("a_preparation_alone_s"), ".3f"),
                       _f(prep.get("a_preparation_under_b_s"), ".3f")]])
    js["ok"] = bool(stages) and all(s.get("rc") == 0 for s in stages)
    return "\n".join(md) + "\n", js


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    d = Path(argv[0])
    md, js = summarize(d)
    (d / "summary.md").write_text(md)
    (d / "summary.json").write_text(json.dumps(js, indent=2, default=str) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

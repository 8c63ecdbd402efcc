"""Rebuild ``patchkv_agent/eval/data/agent_histories.jsonl`` from local clones of two MIT-licensed repositories.

Usage::

    git clone https://github.com/SWE-agent/mini-swe-agent
    git -C mini-swe-agent fetch origin pull/816/head pull/854/head   # the runs live on pull-request heads
    git clone https://github.com/princeton-nlp/SWE-agent
    python scripts/build_agent_histories.py --mini-swe-agent mini-swe-agent --swe-agent SWE-agent

Where the files are (read with ``git show <commit>:<path>``, so the clones' checked-out branch does not matter):

* mini-swe-agent runs (DeepSeek-chat on SWE-bench dev, mini-swe-agent 1.1 tool-calling format):
  ``output/deepseek_chat_dev/<instance>/<instance>.traj.json`` at commit ec0e8e849fea5b1619deb1753007201000904672
  (reachable from ``refs/pull/816/head``; the same files are also indexed at 612b815b904953f77ac6470bc4282f120349337f),
  and ``eval/example_trajectories/astropy__astropy-12907.traj.json`` at commit
  9c0e0e7784f6a45a9ab1c952639055e592577f58 (``refs/pull/854/head``). A plain ``git clone`` does not fetch
  pull-request heads: run the ``git fetch`` line above (or pass a mirror clone).
* SWE-agent demonstrations and test trajectories: ``trajectories/demonstrations/**/*.traj`` and
  ``tests/test_data/trajectories/**/*.traj`` at commit 0772c99cb2903ccf22ba543eaf128742afa470d6 (main).

Normalisation (one JSON object a line, sorted by id): ``system`` (system prompt), then ``messages``: the task as
the first user message, then pairs of one assistant message with exactly one tool call ``{id: cN, name, args}``
and the tool message answering it (an assistant message with several calls is split, thought text on the first).
Text-format SWE-agent steps (action inside the assistant text, observation as the next user message) become a
call named after the action's first word (``bash`` when that is not a plain name) with ``args {"command": action}``;
the thought text is kept as content. SWE-agent in-prompt demonstrations (``is_demo``) are dropped. Caps: one tool
output at most 6,000 characters (cut at a line boundary, ``\\n[... N characters cut]`` appended), at most the first
40 tool calls, at most 60,000 characters per history (system + contents + call arguments; trailing steps dropped).
Histories with fewer than 8 tool calls after that are skipped. Token-like secrets are replaced by ``[REDACTED]``.

Standard library only; run by hand, never at test time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

MINI_REPO = "SWE-agent/mini-swe-agent"
SWE_REPO = "princeton-nlp/SWE-agent"
MINI_RUNS_COMMIT = "ec0e8e849fea5b1619deb1753007201000904672"
MINI_EXAMPLE_COMMIT = "9c0e0e7784f6a45a9ab1c952639055e592577f58"
SWE_COMMIT = "0772c99cb2903ccf22ba543eaf128742afa470d6"

MAX_TOOL_OUTPUT = 6000
MAX_TOOL_CALLS = 40
MAX_HISTORY_CHARS = 60000
MIN_TOOL_CALLS = 8

# mini-swe-agent: (commit, path); the id is "mini-swe-agent/<instance_id>".
_RUN = "output/deepseek_chat_dev/{0}/{0}.traj.json"
MINI_FILES = [(MINI_RUNS_COMMIT, _RUN.format(i)) for i in (
    "marshmallow-code__marshmallow-1343",
    "marshmallow-code__marshmallow-1359",
    "pvlib__pvlib-python-1072",
    "pvlib__pvlib-python-1154",
    "pvlib__pvlib-python-1707",
    "pydicom__pydicom-1139",
    "pydicom__pydicom-1413",
    "pydicom__pydicom-901",
    "pylint-dev__astroid-1196",
    "pylint-dev__astroid-1333",
    "pylint-dev__astroid-1866",
    "pyvista__pyvista-4315",
    "sqlfluff__sqlfluff-1517",
    "sqlfluff__sqlfluff-1625",
    "sqlfluff__sqlfluff-2419",
)] + [(MINI_EXAMPLE_COMMIT, "eval/example_trajectories/astropy__astropy-12907.traj.json")]

# SWE-agent: (instance name used in the id, path at SWE_COMMIT).
_MM = "trajectories/demonstrations/replay__marshmallow-code__marshmallow-1867__{}/marshmallow-code__marshmallow-1867.traj"
SWE_FILES = [
    ("ctf-crypto-BabyEncryption", "trajectories/demonstrations/ctf/crypto/BabyEncryption.traj"),
    ("ctf-crypto-BabyTimeCapsule", "trajectories/demonstrations/ctf/crypto/BabyTimeCapsule.traj"),
    ("ctf-crypto-eps", "trajectories/demonstrations/ctf/crypto/eps.traj"),
    ("ctf-crypto-katy", "trajectories/demonstrations/ctf/crypto/katy.traj"),
    ("ctf-rev-rock", "trajectories/demonstrations/ctf/rev/rock.traj"),
    ("ctf-web-i_got_id_demo", "trajectories/demonstrations/ctf/web/i_got_id_demo.traj"),
    ("marshmallow-code__marshmallow-1867@default_install_from_source",
     _MM.format("default__t-0.20__p-0.95__c-2.00__install-1___install_from_source")),
    ("marshmallow-code__marshmallow-1867@function_calling", _MM.format("function_calling__install-1")),
    ("marshmallow-code__marshmallow-1867@function_calling_replace", _MM.format("function_calling_replace__install-1")),
    ("marshmallow-code__marshmallow-1867@xml_sys-env_cursors_window100",
     _MM.format("xml_sys-env_cursors_window100__t-0.20__p-0.95__c-2.00__install-1")),
    ("pydicom__pydicom-1458", "tests/test_data/trajectories/gpt4__swe-bench-dev-easy_first_only__default__t-0.00__p-0.95__c-3.00__install-1/pydicom__pydicom-1458.traj"),
]

_SECRETS = re.compile(
    r"(sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|AKIA[0-9A-Z]{16}"
    r"|xox[abpr]-[A-Za-z0-9\-]{10,}|hf_[A-Za-z0-9]{30,}|AIza[0-9A-Za-z_\-]{35})"
)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def git_show(repo: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True).stdout.decode("utf-8")


def redact(text: str) -> tuple[str, int]:
    return _SECRETS.subn("[REDACTED]", text)


def cap_output(text: str, limit: int = MAX_TOOL_OUTPUT) -> tuple[str, bool]:
    """At most ``limit`` characters of ``text``, cut at a line boundary, with a note of how much was cut."""
    if len(text) <= limit:
        return text, False
    head = text[:limit]
    nl = head.rfind("\n")
    if nl > 0:
        head = head[:nl]
    return f"{head}\n[... {len(text) - len(head)} characters cut]", True


def tool_name(action: str) -> str:
    words = action.strip().split()
    return words[0] if words and _NAME.match(words[0]) else "bash"


def _args(arguments) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        out = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        return {"command": str(arguments)}
    return out if isinstance(out, dict) else {"command": str(arguments)}


def _calls(raw) -> list[tuple[str, dict]]:
    if isinstance(raw, str):  # one example file stores the list as its Python repr; never eval it
        raise ValueError("tool_calls stored as a string")
    return [(c["function"]["name"], _args(c["function"].get("arguments"))) for c in raw or []]


def _history_chars(system: str, messages: list[dict]) -> int:
    n = len(system)
    for m in messages:
        n += len(m["content"])
        for c in m.get("tool_calls", ()):
            n += len(c["name"]) + len(json.dumps(c["args"], ensure_ascii=False))
    return n


def finish(hid: str, source: str, origin: str, system: str, task: str, steps: list[tuple[str, str, dict, str]]) -> dict | None:
    """steps: (thought, call name, call args, tool output) in order; builds the capped history or None if too short."""
    n_source = len(steps)
    steps = steps[:MAX_TOOL_CALLS]
    messages = [{"role": "user", "content": task}]
    for k, (thought, name, args, output) in enumerate(steps, 1):
        output, _ = cap_output(output)
        cid = f"c{k}"
        messages.append({"role": "assistant", "content": thought, "tool_calls": [{"id": cid, "name": name, "args": args}]})
        messages.append({"role": "tool", "tool_call_id": cid, "content": output})
    while _history_chars(system, messages) > MAX_HISTORY_CHARS and len(messages) > 1:
        del messages[-2:]
    kept = (len(messages) - 1) // 2
    if kept < MIN_TOOL_CALLS:
        return None
    text = json.dumps({"system": system, "messages": messages}, ensure_ascii=False)
    text, n_redacted = redact(text)
    body = json.loads(text)
    return {
        "id": hid, "source": source, "licence": "MIT", "origin": origin,
        "system": body["system"], "messages": body["messages"],
        "truncation": {"tool_calls_in_source": n_source, "tool_calls_kept": kept, "tool_outputs_capped": sum(
            1 for m in body["messages"][2:2 * kept + 1:2] if m["content"].endswith(" characters cut]")),
            "secrets_redacted": n_redacted, "chars": _history_chars(body["system"], body["messages"])},
    }


def from_mini(data: dict, hid: str, origin: str) -> dict | None:
    msgs = data["messages"]
    system = next(m["content"] for m in msgs if m["role"] == "system")
    task = next(m["content"] for m in msgs if m["role"] == "user")
    outputs = {m["tool_call_id"]: m.get("content") or "" for m in msgs if m["role"] == "tool"}
    steps = []
    for m in msgs:
        if m["role"] != "assistant":
            continue
        raw = m.get("tool_calls") or []
        if isinstance(raw, str) or not raw:
            break  # an unparseable or call-less turn ends the usable prefix
        thought = m.get("content") or ""
        for c in raw:
            if c["id"] not in outputs:
                break
            steps.append((thought, c["function"]["name"], _args(c["function"].get("arguments")), outputs[c["id"]]))
            thought = ""
        else:
            continue
        break
    return finish(hid, "mini-swe-agent", origin, system, task, steps)


def from_swe(data: dict, hid: str, origin: str) -> dict | None:
    hist = [m for m in data["history"] if not m.get("is_demo")]
    system = "\n\n".join(m["content"] for m in hist if m["role"] == "system")
    body = [m for m in hist if m["role"] != "system"]
    if not body or body[0]["role"] != "user":
        return None
    task = body[0]["content"]
    traj = data.get("trajectory") or []
    steps, n_action = [], 0
    i = 1
    while i < len(body):
        m = body[i]
        if m["role"] != "assistant":
            i += 1
            continue
        action = m.get("action") or ""
        thought = m.get("thought") if m.get("thought") is not None else m.get("content") or ""
        calls = _calls(m.get("tool_calls")) if m.get("tool_calls") else [(tool_name(action), {"command": action.rstrip("\n")})]
        nxt = body[i + 1] if i + 1 < len(body) else None
        if nxt is not None and nxt["role"] in ("user", "tool"):
            output = nxt["content"]
            i += 2
        else:  # the last action: its result is only in the trajectory (which may hold extra, unshown steps)
            match = [s for s in traj[n_action:] if (s.get("action") or "") == action]
            if not match:
                break
            output = match[0].get("observation") or ""
            i += 1
        n_action += 1
        if len(calls) != 1:  # function-calling observations answer all calls at once; keep the first call only
            calls = calls[:1]
        name, args = calls[0]
        steps.append((thought, name, args, output))
    return finish(hid, "swe-agent", origin, system, task, steps)


def build(mini_dir: str, swe_dir: str) -> list[dict]:
    out = []
    for commit, path in MINI_FILES:
        data = json.loads(git_show(mini_dir, commit, path))
        iid = data.get("instance_id") or Path(path).name.split(".")[0]
        h = from_mini(data, f"mini-swe-agent/{iid}", f"https://github.com/{MINI_REPO}/blob/{commit}/{path}")
        if h is None:
            print(f"skip (too short): {path}", file=sys.stderr)
        else:
            out.append(h)
    for name, path in SWE_FILES:
        data = json.loads(git_show(swe_dir, SWE_COMMIT, path))
        h = from_swe(data, f"swe-agent/{name}", f"https://github.com/{SWE_REPO}/blob/{SWE_COMMIT}/{path}")
        if h is None:
            print(f"skip (too short): {path}", file=sys.stderr)
        else:
            out.append(h)
    out.sort(key=lambda h: h["id"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mini-swe-agent", required=True, metavar="DIR", help="clone (or bare mirror) of SWE-agent/mini-swe-agent")
    ap.add_argument("--swe-agent", required=True, metavar="DIR", help="clone (or bare mirror) of princeton-nlp/SWE-agent")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "patchkv_agent/eval/data/agent_histories.jsonl"))
    args = ap.parse_args(argv)
    hist = build(args.mini_swe_agent, args.swe_agent)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for h in hist:
            f.write(json.dumps(h, ensure_ascii=False, sort_keys=False) + "\n")
    chars = [h["truncation"]["chars"] for h in hist]
    for src in ("mini-swe-agent", "swe-agent"):
        sub = [h for h in hist if h["source"] == src]
        print(f"{src}: {len(sub)} histories, tool calls {sum(h['truncation']['tool_calls_kept'] for h in sub)}")
    print(f"{len(hist)} histories, {Path(args.out).stat().st_size} bytes; chars/history min {min(chars)} "
          f"median {statistics.median(chars)} max {max(chars)}; redacted {sum(h['truncation']['secrets_redacted'] for h in hist)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

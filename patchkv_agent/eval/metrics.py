"""Fidelity metrics of a resume against the exact reference, and answer F1 against gold answers.

The fields of the result format (``docs/TRACES.md``): ``first_token_kl``, ``top1_agree``, ``tf_agree``,
``exact_continuation`` (:func:`fidelity` computes all four), ``f1`` (:func:`token_f1`) and the edit-following
fields ``follows`` / ``stale`` (:func:`answer_match` against a version's gold and the previous version's). Used by the
trace replay, the benchmark, the transport benchmark and the calibration profiler and analysis, so that
every number called "KL" or "agreement" in this project is computed one way.

Boundary: reads a :class:`~patchkv_agent.engine.ResumeResult`'s logits, output ids and K/V, and runs the
engine's model for teacher forcing; strategies and stores are not known here.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Any, Iterable, Sequence

import torch

from ..core.models import cache_kwarg

__all__ = ["normalize_answer", "token_f1", "answer_match", "ANSWER_WORDS", "first_token_kl", "top1_agree", "teacher_forced_agreement", "fidelity"]


def normalize_answer(s: str) -> str:
    """SQuAD answer normalisation: lower case, no punctuation, no articles, single spaces.

    Args:
        s: an answer or a prediction.

    Returns:
        The normalised text.
    """
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, answers: Iterable[str]) -> float:
    """Max SQuAD token F1 of ``prediction`` over ``answers``.

    Args:
        prediction: the model's text.
        answers: gold answers (aliases).

    Returns:
        The best F1 in ``[0, 1]`` (0.0 when ``answers`` is empty).
    """
    best = 0.0
    pred = normalize_answer(prediction).split()
    for ans in answers:
        gold = normalize_answer(ans).split()
        common = collections.Counter(pred) & collections.Counter(gold)
        same = sum(common.values())
        if not pred or not gold:
            f1 = float(pred == gold)
        elif same == 0:
            f1 = 0.0
        else:
            p, r = same / len(pred), same / len(gold)
            f1 = 2 * p * r / (p + r)
        best = max(best, f1)
    return best


ANSWER_WORDS = 24  # answer_match looks at this many leading words of the output


def answer_match(prediction: str, answers: Iterable[str], *, words: int = ANSWER_WORDS) -> bool:
    """Whether the answer the model gave is one of ``answers``: some gold alias, normalised, occurs as a
    whole-word run within the first ``words`` normalised words of the first non-empty line.

    Used for the edit-following fields: a row *follows* when it matches its version's gold answers and is
    *stale* when it matches the previous version's. Only the leading words count, so a model that states
    the new value and then rambles about the old one still follows, and one that answers the old value
    first is stale.

    Args:
        prediction: the model's text.
        answers: gold answers (aliases); empty: never a match.
        words: leading words considered, ``>= 1``.

    Returns:
        True on a match.
    """
    line = next((ln for ln in prediction.splitlines() if ln.strip()), "")
    pred = normalize_answer(line).split()[:words]
    for ans in answers:
        gold = normalize_answer(ans).split()
        if gold and any(pred[i:i + len(gold)] == gold for i in range(len(pred) - len(gold) + 1)):
            return True
    return False


def first_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) of the first-token distributions, in nats (float64 softmax, clamped at 0).

    Args:
        ref_logits: the reference's first-token logits ``[V]``.
        logits: the compared first-token logits ``[V]``.

    Returns:
        The divergence.
    """
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))


def top1_agree(ref_logits: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether the two first-token argmaxes are equal.

    Args:
        ref_logits: the reference's first-token logits.
        logits: the compared first-token logits.

    Returns:
        True when they pick the same token.
    """
    return bool(int(ref_logits.argmax()) == int(logits.argmax()))


@torch.no_grad()
def teacher_forced_agreement(engine, res, ref_ids: Sequence[int]) -> float:
    """Fraction of steps whose argmax equals ``ref_ids`` when feeding ``ref_ids`` over ``res``'s KV.

    Step 0 is ``res``'s own first-token logits; steps 1.. come from one forward of ``ref_ids[:-1]`` on a
    copy of ``res``'s cache at the positions after its context.

    Args:
        engine: the engine whose model produced ``res``.
        res: a :class:`~patchkv_agent.engine.ResumeResult` (logits, K/V, context ids).
        ref_ids: the reference continuation (exact's greedy output).

    Returns:
        The agreement in ``[0, 1]`` (1.0 for an empty reference).
    """
    ref_ids = list(ref_ids)
    if not ref_ids:
        return 1.0
    preds = [int(res.logits.argmax())]
    if len(ref_ids) > 1:
        cache = engine.runner.dynamic_cache(res.keys, res.values)
        n = len(res.context_ids)
        feed = torch.tensor([ref_ids[:-1]], device=engine.device)
        pos = torch.arange(n, n + len(ref_ids) - 1, device=engine.device)[None]
        logits = engine.model(input_ids=feed, position_ids=pos, **{cache_kwarg(engine.model): cache}, use_cache=True).logits[0]
        preds += logits.argmax(-1).tolist()
    return sum(int(a == b) for a, b in zip(preds, ref_ids)) / len(ref_ids)


def fidelity(engine, res, ref) -> dict[str, Any]:
    """The four fidelity fields of a result row: ``res`` scored against the exact reference ``ref``.

    Args:
        engine: the engine that produced both.
        res: the strategy's :class:`~patchkv_agent.engine.ResumeResult`.
        ref: the ``exact`` result for the same context.

    Returns:
        ``{"first_token_kl", "top1_agree", "tf_agree", "exact_continuation"}``.
    """
    ref_out = list(ref.output_ids)
    return {
        "first_token_kl": first_token_kl(ref.logits, res.logits),
        "top1_agree": top1_agree(ref.logits, res.logits),
        "tf_agree": teacher_forced_agreement(engine, res, ref_out),
        "exact_continuation": bool(list(res.output_ids) == ref_out),
    }


NEXT_ACTION_TOKENS = 48  # greedy tokens an agent replay decodes: the next tool call, or this much text


def next_action(text: str) -> tuple:
    """The agent's next action in a greedy continuation: its first tool call, else its text.

    Args:
        text: the decoded continuation (special tokens skipped).

    Returns:
        ``("call", name, arguments as canonical JSON)`` for a ``<tool_call>{...}</tool_call>`` block
        that parses (the first one; text after it is not part of the action), ``("call-text", raw)`` for
        an opened call that does not parse, else ``("text", text stripped)``.
    """
    import json

    from ..langgraph.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ("text", text.strip())
    end = text.find(TOOL_CALL_CLOSE, start)
    body = text[start + len(TOOL_CALL_OPEN): end if end >= 0 else len(text)]
    try:
        call = json.loads(body)
        name, args = call["name"], call.get("arguments", call.get("args", {}))
        return ("call", str(name), json.dumps(args, sort_keys=True))
    except (ValueError, KeyError, TypeError):
        return ("call-text", body.strip())


def next_action_agree(text: str, ref_text: str) -> bool:
    """Whether a continuation takes the same next action as the exact one (:func:`next_action`): the same
    tool name and arguments, or, without a call, the same text (both cut at the same token budget)."""
    return next_action(text) == next_action(ref_text)


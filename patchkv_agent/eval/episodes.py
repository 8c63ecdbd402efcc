"""The evaluation episodes of every workload by name: QA and edit-following traces, agent traces and agent
loop episodes with their tool waits.

The one entry point that the calibration, ``patchkv-agent demo`` and the benchmarks (``benchmarks/``) build
their episodes with; it dispatches to :mod:`.workloads` and :mod:`.agent_workloads` and knows nothing about
running them.
"""

from __future__ import annotations


def build_workload_traces(workload: str, edit: str = "all", *, n: int | None = None, target_tokens: int = 3000,
                          n_versions: int | None = None, seed: int = 0, count_tokens=None,
                          context: int | None = None) -> list[dict]:
    """The evaluation traces of any benchmark workload: QA and edit-following ones
    (:func:`.workloads.build_traces`) or the agent workloads edited by LangChain's middlewares
    (:func:`.agent_workloads.build_agent_traces`; there ``target_tokens`` is the largest version, at least
    2,000 tokens, ``n_versions`` the versions kept per episode (default 5), ``edit`` does not apply, and
    ``context`` builds the episodes for a longer window instead: see :func:`agent_loop_episodes`).

    Args:
        workload: a workload name.
        edit: the QA workloads' edit kind (or ``all``).
        n: episodes at most.
        target_tokens: QA: version-0 length; agent: largest version.
        n_versions: versions per episode, ``>= 2`` (None: 2, the agent workloads 5).
        seed: the builders' seed.
        count_tokens: ``trace messages -> token count`` (the model's chat-template count), or None.
        context: agent workloads: a context budget in tokens (None: ``target_tokens`` as today); QA
            workloads: unused (their length is ``target_tokens``).

    Returns:
        Trace dicts (``docs/TRACES.md``).

    Raises:
        ValueError: an unknown workload, edit or split, or ``context < 1000``.
    """
    from .agent_workloads import AGENT_WORKLOADS
    from .workloads import build_traces

    if workload in AGENT_WORKLOADS:
        return [ep.trace for ep in agent_loop_episodes(workload, n=n, target_tokens=target_tokens,
                                                       n_versions=n_versions, seed=seed, count_tokens=count_tokens,
                                                       context=context)]
    return build_traces(workload, edit, n=n, split="eval", target_tokens=target_tokens, n_versions=n_versions or 2,
                        seed=seed, count_tokens=count_tokens)


def agent_loop_episodes(workload: str, *, n: int | None = None, target_tokens: int = 3000,
                        n_versions: int | None = None, seed: int = 0, count_tokens=None, context: int | None = None,
                        progress: bool = False) -> list:
    """An agent workload's episodes with their tool waits (:func:`.agent_workloads.build_agent_loop_episodes`),
    built as :func:`build_workload_traces` builds the agent traces (its ``trace`` fields are those).

    Args:
        workload: an agent workload (:data:`.agent_workloads.AGENT_WORKLOADS`).
        n: episodes at most.
        target_tokens: the largest version (at least 2,000 tokens), unless ``context`` is given.
        n_versions: versions per episode (None: 5).
        seed: the builder's seed.
        count_tokens: ``trace messages -> token count`` (the model's chat-template count), or None.
        context: a context budget in tokens: the versions run up to it, start at half of it, the middleware
            settings are scaled to it and every ``unedited`` twin fits in it; None: ``target_tokens``.
        progress: a tqdm bar over the histories.

    Returns:
        :class:`~.agent_workloads.AgentLoopEpisode` objects.

    Raises:
        ValueError: not an agent workload, or ``context < 1000``.
    """
    from .agent_workloads import build_agent_loop_episodes, from_langchain

    count = (lambda msgs: count_tokens(from_langchain(msgs))) if count_tokens is not None else None
    return build_agent_loop_episodes(workload, n=n, count_tokens=count, max_tokens=max(2000, target_tokens),
                                     max_versions=5 if n_versions is None else n_versions, seed=seed, context=context,
                                     progress=progress)

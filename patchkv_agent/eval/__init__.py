"""Evaluation and tooling over the library: traces, workloads, replay, benchmarks, load tests.

- :mod:`.workloads`: edited-context agent traces from the packaged QA data (``data/``);
  :mod:`.follow`: edit-following templates whose gold answer changes with the edit.
- :mod:`.replay`: replay traces under strategies, with fidelity fields (KL, top-1, agreement, F1).
- :mod:`.bench`: the edited-context benchmark; :mod:`.transport_bench`: the checkpoint transport one;
  :mod:`.loop_bench`: the agent loop (call, tool, edited call) as the caller waits for it;
  :mod:`.prepared_bench`: that loop with the next call prepared while the tools run (the agent workloads'
  own editors predict it), against today's resume, prefix and the no-edit floor.
- :mod:`.agent_workloads`: agent histories edited by LangChain's middlewares (traces, and loop episodes
  with what the agent knows while its tools run).
- :mod:`.stress`, :mod:`.faults`, :mod:`.properties`: concurrent load over a budgeted store, its fault
  mode; property check of diff + plan + recover (:mod:`.stress_cli`: the ``stress`` command over both).

The library (core, strategies, engine, runtime, langgraph) imports nothing from here.
"""

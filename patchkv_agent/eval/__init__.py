"""Evaluation and tooling over the library: traces, workloads, replay, benchmarks, load tests.

- :mod:`.workloads`: edited-context agent traces from the packaged QA data (``data/``).
- :mod:`.replay`: replay traces under strategies, with fidelity fields (KL, top-1, agreement, F1).
- :mod:`.bench`: the edited-context benchmark; :mod:`.transport_bench`: the checkpoint transport one.
- :mod:`.stress`, :mod:`.properties`: concurrent load over a budgeted store; property check of
  diff + plan + recover.

The library (core, strategies, engine, runtime, langgraph) imports nothing from here.
"""

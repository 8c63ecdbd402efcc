"""Evaluation inputs and measures that the library's own commands use: workloads, traces, metrics, replay.

- :mod:`.workloads`: edited-context agent traces from the packaged QA data (``data/``);
  :mod:`.follow`: edit-following templates whose gold answer changes with the edit;
  :mod:`.agent_workloads` (with :mod:`.agent_editors`): agent histories edited by LangChain's middlewares
  (traces, and loop episodes with what the agent knows while its tools run); :mod:`.episodes`: every
  workload's evaluation episodes by name.
- :mod:`.traces`: the trace and result formats; :mod:`.metrics`: fidelity measures; :mod:`.noise_floor`:
  accepted approximations of exact; :mod:`.replay`: replay traces under strategies (``demo``, ``replay``).

The calibration (``patchkv-agent calibrate``) and the CLI build on these; the benchmark harness (runners,
load tests and their commands) is the checkout's ``benchmarks/`` package, which nothing here imports.
The library below (core, strategies, engine, runtime, langgraph) imports nothing from here.
"""

"""The benchmark harness beside the library: runners, load tests and their commands; not installed.

The library (``patchkv_agent``, its calibration included) imports nothing from here; ``patchkv-agent``'s
benchmark subcommands load it by name when one runs (:mod:`patchkv_agent.cli_bench`), so they work from a
clone of the repository. Workloads, traces, metrics and replay stay in :mod:`patchkv_agent.eval`.

- :mod:`.bench`: the edited-context benchmark (``bench``); :mod:`.transport_bench`: the checkpoint transport
  one (``bench-transport``); :mod:`.host_bench`: the resume path's host time (``bench-host``).
- :mod:`.loop_bench`: the agent loop (call, tool, edited call) as the caller waits for it;
  :mod:`.prepared_bench`: that loop with the next call prepared while the tools run (``bench-loop``).
- :mod:`.server_bench`, :mod:`.servers`: agents on a live vLLM / llama.cpp server (``bench-server``).
- :mod:`.stress`, :mod:`.faults`, :mod:`.properties`, :mod:`.entry_fuzz`: concurrent load over a budgeted
  store, its fault mode, property checks (``stress``); :mod:`.tiny`, :mod:`.redis_server`: their fixtures.
- :mod:`.noninferiority`: the non-inferiority test of the benchmark summaries.
"""

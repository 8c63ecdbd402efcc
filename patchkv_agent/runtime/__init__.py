"""The agent runtime around the engine: per-thread context versions and checkpoint tiers.

- :mod:`.threads`: :class:`~.threads.ThreadRegistry`, the public facade over the four objects below.
- :mod:`.table`: :class:`~.table.ThreadTable`, what the threads hold (records, their locks, active contexts).
- :mod:`.calls`: :class:`~.calls.CallPath`, how a call is served, top to bottom.
- :mod:`.residency`: :class:`~.residency.Residency`, the background offloads and heals, store entries, budgets.
- :mod:`.preparation`: :class:`~.preparation.Preparations`, the tool-wait preparation of next contexts
  (:mod:`.background`: a prediction's own model calls).
- :mod:`.keys`, :mod:`.state`, :mod:`.stream`: thread keys, the per-thread record and token streams.
- :mod:`.lifecycle`: the thread's states (where its KV is, its background job, its preparation), their moves and
  the invariants between them.
- :mod:`.kvstore`: memory / disk / Redis checkpoint tiers behind one interface, resume with safe fallback.
"""

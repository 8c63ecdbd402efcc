"""The agent runtime around the engine: per-thread context versions and checkpoint tiers.

- :mod:`.threads`: :class:`~.threads.ThreadRegistry` (thread state, resident budget, background offload).
- :mod:`.keys`, :mod:`.state`, :mod:`.stream`: its thread keys, per-thread record and token streams.
- :mod:`.lifecycle`: the thread's states (where its KV is, its background job, its preparation), their moves and
  the invariants between them.
- :mod:`.kvstore`: memory / disk / Redis checkpoint tiers behind one interface, resume with safe fallback.
"""

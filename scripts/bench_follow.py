"""The edit-following benchmark: ``patchkv-agent bench`` on the four follow-* workloads, with one extra strategy.

``patchkv-noreaders`` is ``patchkv`` with the reader-block signal off (``readers="none"``: the plan before
edit-following, window + last block only), registered here so that one run measures what the reader
blocks buy beside direct and CacheBlend. Arguments pass through to ``patchkv-agent bench``, e.g.

    .venv/bin/python scripts/bench_follow.py --n 40 --out-dir runs/follow
"""

from __future__ import annotations

import sys

from patchkv_agent.cli import main
from patchkv_agent.strategies import register_strategy
from patchkv_agent.strategies.builtin import PatchKVStrategy


@register_strategy
class NoReaders(PatchKVStrategy):
    name = "patchkv-noreaders"

    def __init__(self):
        super().__init__(readers="none")


if __name__ == "__main__":
    args = ["bench", "--workloads", "follow-lookup,follow-twohop,follow-count,follow-retract",
            "--strategies", "exact,prefix,direct,cacheblend,patchkv-noreaders,patchkv"] + sys.argv[1:]
    sys.exit(main(args))

"""Next-token choice: greedy or seeded temperature / top-p sampling, after an optional logits processor.

A :class:`Sampler` is the one hook a decode step calls with the step's logits; it returns the token id.
A *logits processor* (anything with ``__call__(logits) -> logits``, ``accept(token)`` and a ``done``
property; e.g. a grammar matcher from :mod:`patchkv_agent.langgraph.grammar`) masks disallowed tokens
before the choice, is told the chosen token after it, and says when the output is complete.

Knows torch only: nothing about models, caches or chat templates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    """Constrains one decode's tokens (a grammar, a ban list ...)."""

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Return the logits to choose from (may modify ``logits`` in place); ``[vocab]`` float."""

    def accept(self, token: int) -> None:
        """Advance with the chosen token."""

    @property
    def done(self) -> bool:
        """True when the output is complete (the decode stops after the token just accepted)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    Attributes:
        temperature: 0 (default) is greedy; > 0 samples from ``softmax(logits / temperature)``.
        top_p: nucleus sampling mass in (0, 1] (1: the whole distribution); ignored when greedy.
        seed: seed of the sampling generator (same seed, same context: same tokens); None draws one.

    Raises:
        ValueError: a negative temperature or a top_p outside (0, 1].
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature is None or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_p is None or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


class Sampler:
    """Chooses each next token of one decode.

    Args:
        params: :class:`SamplingParams` (greedy by default).
        processor: optional :class:`LogitsProcessor` applied before the choice.
    """

    def __init__(self, params: SamplingParams = GREEDY, processor: LogitsProcessor | None = None):
        self.params = params
        self.processor = processor
        self._gen: torch.Generator | None = None
        if not params.greedy:
            self._gen = torch.Generator(device="cpu")
            self._gen.manual_seed(params.seed if params.seed is not None else random.randrange(1 << 62))

    @property
    def done(self) -> bool:
        """Whether the processor says the output is complete."""
        return self.processor is not None and self.processor.done

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from one step's ``[vocab]`` logits (the processor, if any, is advanced with it).

        Raises:
            RuntimeError: the processor allows no token (a bug in the grammar or the vocabulary map).
        """
        logits = logits.detach().float().reshape(-1)
        if self.processor is not None:
            logits = self.processor(logits.clone())
            if not torch.isfinite(logits).any():
                raise RuntimeError("the logits processor allowed no token at this step")
        if self.params.greedy:
            tok = int(logits.argmax())
        else:
            tok = _sample(logits.cpu(), self.params, self._gen)
        if self.processor is not None:
            self.processor.accept(tok)
        return tok


def _sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < params.top_p  # always keeps the top token
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))

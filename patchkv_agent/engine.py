"""PatchKVEngine: the object users hold.

``checkpoint(ids)`` runs the checkpoint-creation pass (prefill + attention statistics) and offloads the KV to
CPU; ``resume(ckpt, new_ids, strategy=...)`` diffs the versions, plans, restores, recomputes, and decodes greedily.
Validates input before any compute (one validator, :mod:`patchkv_agent.core.inputs`); an unsupported case (RoPE
kind, a corrupt run, weights changed in place since the checkpoint) takes the exact path and says so in
``stats["fallback"]`` (a :class:`~patchkv_agent.core.fallback.Fallback`). Settings live in one frozen
:class:`~patchkv_agent.core.settings.RecoverySettings` that strategies read; the engine writes the
:class:`~patchkv_agent.results.EnginePart` of a result's :class:`ResumeStats` and a checkpoint's
:class:`~patchkv_agent.core.provenance.CheckpointProvenance`. Any number of registries and callers share one engine.

What the engine keeps about the model (its forward lock, attention capture, weight watch, cache layout,
device) is the model's :class:`~patchkv_agent.core.runner.ModelRunner`, shared by every engine over the same
model instance; nothing is set on the model. K/V pass between the engine's paths in the runner's one layout
(``[1, H, N, D]`` per layer on the model's device); :mod:`patchkv_agent.offload` is where they become a
checkpoint (``[H, N, D]`` on the CPU) and the runner's ``dynamic_cache`` where they become the decode cache.
The resume's critical path is :mod:`patchkv_agent.resume`; this module checks inputs and weights and holds
the lock around it.

Knows models, diff, plan, strategies and recovery; knows nothing about the runtime or LangGraph.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .core.checkpoint import Checkpoint, identity_fallback
from .core.diff import Edit, diff_versions
from .core.encoding import SegmentEncoder
from .core.lexicon import WordIndex
from .core.fallback import Fallback, FallbackKind
from .core.inputs import InvalidInput, as_token_ids, check_max_new_tokens
from .core.models import ModelSpec, fingerprint, model_spec
from .loading import DEFAULT_MODEL, load_model
from .core.plan import DEFAULT_BLOCK_SIZE, DEFAULT_DIRTY_WINDOW
from .core.prepare import DEFAULT_CHUNK_TOKENS, prepare_exact
from .core.recovery import FullRecompute, check_attn_implementation, execute
from .core.runner import ModelRunner, stored_layout
from .core.settings import RecoverySettings
from .kernels import native
from .profiles import Profile, load_profile
from .profiles import profile_dirs as profile_dir_list
from .core.provenance import Source
from .offload import offload, resident_checkpoint, scores_for
from .results import EnginePart, PrepareStats, ResumeResult, ResumeStats
from .resume import ResumeRequest, run_resume
from .strategies import Strategy, get_strategy

__all__ = ["PatchKVEngine", "ResumeResult", "ResumeStats", "RecoverySettings", "Fallback", "FallbackKind",
           "InvalidInput", "DEFAULT_BLOCK_SIZE", "DEFAULT_DIRTY_WINDOW"]


class PatchKVEngine:
    """Selective KV recovery over one Hugging Face causal LM.

    Args:
        model: a loaded transformers causal LM with sdpa or eager attention.
        tokenizer: its tokenizer, or None when callers pass token ids only.
        settings: a whole :class:`RecoverySettings` to start from instead of a profile's (no profile is
            looked up).
        profile: ``"auto"`` (default) finds this model's calibration profile by fingerprint (or by the
            name it was loaded by) in ``profile_dirs`` and the search path of
            :func:`patchkv_agent.profiles.profile_dirs` (``$PATCHKV_PROFILE_DIR``, the user cache, the
            shipped profiles); a :class:`~patchkv_agent.profiles.Profile` applies that one; None uses
            the built-in defaults.
        profile_dirs: folders searched first by ``profile="auto"`` (e.g. a calibration run's output).
        source: the name the model was loaded by (a profile is also looked up by it; set by
            :meth:`from_pretrained`; nothing is written on the model).
        **overrides: :class:`RecoverySettings` fields by name (``block_size``, ``kappa``, ``length_model``,
            ``capture_window``, ``mixed_precision``, ``precision_policy``, ``readers``, ...; each documented,
            defaulted and checked there) and the alias ``dirty_window`` (a fixed window, below a
            ``length_model`` given too); they win over ``settings`` and the profile (None: not given).

    Attributes:
        settings: the :class:`RecoverySettings` every checkpoint and resume reads (frozen). Built once
            from the profile and the explicit arguments; to change it, assign a whole new value
            (``engine.settings = engine.settings.replace(kappa=0.1)``). ``repr(engine)`` shows each
            field and where it came from (:attr:`settings_sources`).
        profile: the :class:`~patchkv_agent.profiles.Profile` the settings started from, or None.
        runner: the model's :class:`~patchkv_agent.core.runner.ModelRunner` (its forward lock, attention
            capture, weight watch, cache layout and device; nothing is set on the model). Every engine built
            over the same model instance gets the same runner (:meth:`ModelRunner.of`).
        model: the model (``runner.model``).
        forward_lock: the runner's re-entrant lock, held around every forward pass through the model
            (``checkpoint``, ``checkpoint_from``, ``resume``; runtime decode steps take it too): one
            forward at a time per model, whatever number of engines, registries and direct callers share
            it, so the attention capture of a checkpoint pass never sees another caller's forward.
        spec: the :class:`ModelSpec`; ``spec.fingerprint`` follows in-place weight changes (see
            :meth:`refresh_fingerprint`).

    Raises:
        ValueError: the model's attention implementation cannot take per-token masks, or a setting is
            outside its range.
        TypeError: an override that names no setting (the message lists the settings).
    """

    def __init__(self, model, tokenizer=None, *, settings: RecoverySettings | None = None,
                 profile: Profile | str | None = "auto", profile_dirs: Sequence[str | Path] = (),
                 source: str | None = None, **overrides):
        explicit = RecoverySettings.overrides(overrides, where="PatchKVEngine")  # misuse raises before any work
        check_attn_implementation(model)
        self.source = source
        # engines over one model instance share its runner: one forward lock, capture and weight watch per model
        self.runner: ModelRunner = ModelRunner.of(model.eval())
        self._weights_seen = self.runner.weights_version()  # the weights spec.fingerprint is of
        self.tokenizer = tokenizer
        # the lexical reader signal compares words, not token ids (None without a tokenizer: token ids)
        self.words: WordIndex | None = (WordIndex.from_tokenizer(tokenizer)
                                        if hasattr(tokenizer, "convert_ids_to_tokens") else None)
        self._encoder: SegmentEncoder | None = None
        self.spec: ModelSpec = model_spec(model, tokenizer)
        self.profile: Profile | None = None
        if settings is not None and not isinstance(settings, RecoverySettings):
            raise ValueError(f"settings must be a RecoverySettings, got {type(settings).__name__}")
        sources = dict.fromkeys(RecoverySettings.field_names(), "default")
        if settings is not None:
            base = settings
            sources.update({k: "settings" for k in settings.changed_fields()})
        else:
            self.profile = self._find_profile(profile, profile_dirs)
            base = RecoverySettings()
            if self.profile is not None:
                base = self.profile.settings(base)
                sources.update(dict.fromkeys(self.profile.fields(), f"profile {self.profile.path or '(given)'}"))
        # explicit arguments win over the profile (and over `settings`)
        self._settings: RecoverySettings = base.replace(**explicit)
        sources.update(dict.fromkeys(explicit, "argument"))
        self._sources = sources
        native.available()  # load (or, once per CPU, build) kernels/native.c here, not on the first resume's plan
        self._past_fingerprints: set[str] = set()
        eos = getattr(model.config, "eos_token_id", None)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))

    @property
    def model(self):
        """The model (``runner.model``)."""
        return self.runner.model

    @property
    def forward_lock(self):
        """The model's :class:`~patchkv_agent.core.weights.ForwardLock` (``runner.lock``)."""
        return self.runner.lock

    @property
    def device(self) -> torch.device:
        """Where the model runs (read live from its first parameter)."""
        return self.runner.device

    def _find_profile(self, profile, profile_dirs) -> Profile | None:
        if profile is None or isinstance(profile, Profile):
            return profile
        if profile == "auto":
            return load_profile(self.spec.fingerprint, model_name=self.source,
                                dirs=profile_dir_list(profile_dirs))
        if isinstance(profile, dict):
            raise ValueError("profile takes a Profile, not a dict: pass Profile.from_dict(d) "
                             "(patchkv_agent.profiles), 'auto' or None")
        raise ValueError("profile must be 'auto', a Profile (patchkv_agent.profiles.load_profile / read_profile) "
                         f"or None, got {profile!r}")

    # ------------------------------------------------- settings (one frozen value; replace it whole)

    @property
    def settings(self) -> RecoverySettings:
        """The :class:`RecoverySettings` every checkpoint and resume reads (frozen)."""
        return self._settings

    @settings.setter
    def settings(self, value: RecoverySettings) -> None:
        if not isinstance(value, RecoverySettings):
            raise TypeError(f"settings must be a RecoverySettings (engine.settings.replace(...)), got "
                            f"{type(value).__name__}")
        old, self._settings = self._settings, value
        self._sources.update({k: "assigned" for k in RecoverySettings.field_names()
                              if getattr(old, k) != getattr(value, k)})

    def __setattr__(self, name: str, value) -> None:
        if name in _SETTINGS_FIELDS:  # the engine has no per-field setters: say what to do instead
            raise AttributeError(f"PatchKVEngine has no attribute {name!r} to set: replace the frozen settings "
                                 f"whole, engine.settings = engine.settings.replace({name}=...)")
        super().__setattr__(name, value)

    @property
    def encoder(self) -> SegmentEncoder | None:
        """Text -> ids from memoized pieces between the tokenizer's added tokens (None without a tokenizer):
        an edited conversation is tokenized where it changed, with the ids a whole-text call gives
        (:mod:`patchkv_agent.core.encoding`). Rebuilt when ``tokenizer`` is replaced."""
        enc = self._encoder
        if self.tokenizer is None:
            return None
        if enc is None or enc.tokenizer is not self.tokenizer:
            enc = self._encoder = SegmentEncoder(self.tokenizer)
        return enc

    @property
    def settings_sources(self) -> dict[str, str]:
        """Where each settings field came from: ``default``, ``profile <path>``, ``settings`` (the
        ``settings=`` argument), ``argument`` (an explicit keyword) or ``assigned`` (``engine.settings = ...``)."""
        return dict(self._sources)

    @property
    def profile_path(self) -> str | None:
        """The path of the profile the settings came from (None: no profile, or one given without a file)."""
        return None if self.profile is None else self.profile.path

    def __repr__(self) -> str:
        return f"PatchKVEngine({self.source or type(self.model).__name__}, {self._settings.describe(self._sources)})"

    @classmethod
    def from_pretrained(cls, name_or_path: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", settings: RecoverySettings | None = None,
                        profile: Profile | str | None = "auto", profile_dirs: Sequence[str | Path] = (),
                        **overrides) -> "PatchKVEngine":
        """Load a model (HF id, local dir, ``.gguf`` path or ``"smollm2-135m"``) and wrap it.

        Args:
            name_or_path: what to load (see :func:`patchkv_agent.loading.load_model`); the engine's ``source``.
            dtype, device: parameter dtype, and where the model runs.
            settings, profile, profile_dirs, **overrides: as for :class:`PatchKVEngine`.

        Returns:
            The engine.

        Raises:
            FileNotFoundError, ValueError: see :func:`patchkv_agent.loading.load_model`; a setting out of range.
            TypeError: an override that names no setting (checked before the model loads).
        """
        RecoverySettings.overrides(overrides, where="PatchKVEngine.from_pretrained")
        model, tok = load_model(name_or_path, dtype=dtype, device=device)
        return cls(model, tok, settings=settings, profile=profile, profile_dirs=profile_dirs,
                   source=str(name_or_path), **overrides)

    # ----------------------------------------------------------------- input

    def encode(self, context: str | Sequence[dict] | Sequence[int]) -> list[int]:
        """Token ids of a context: chat messages (chat template, generation prompt added), raw text, or ids.

        Args:
            context: a string, a list of ``{"role", "content"}`` message dicts, or token ids (validated
                like :meth:`validate_ids`).

        Returns:
            The token ids (:meth:`encode_array` as a list).

        Raises:
            InvalidInput: (a ``ValueError`` and ``TypeError``) a single message dict, a list mixing
                messages and other things, or bad ids.
            ValueError: text or messages without a tokenizer.
        """
        return self.encode_array(context).tolist()

    def encode_array(self, context: str | Sequence[dict] | Sequence[int]) -> np.ndarray:
        """:meth:`encode` as a fresh int64 array, the form :meth:`resume` checks in one pass (no per-id
        conversion): text is tokenized through :attr:`encoder`, so an edited conversation is tokenized where
        it changed.

        Args:
            context: as :meth:`encode`.
        Returns:
            int64 ``[n]``.
        Raises:
            InvalidInput, ValueError: as :meth:`encode`.
        """
        if isinstance(context, dict):
            raise InvalidInput("encode takes chat messages as a list of {'role', 'content'} dicts, text, or token "
                               "ids; got one dict: wrap the message in a list")
        is_messages = isinstance(context, (list, tuple)) and len(context) and isinstance(context[0], dict)
        if isinstance(context, str) or is_messages:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids, or build it with a tokenizer")
            if isinstance(context, str):
                return self.encoder.encode(context)
            bad = [i for i, m in enumerate(context) if not isinstance(m, dict)]
            if bad:
                raise InvalidInput(f"encode got a message list whose element {bad[0]} is "
                                   f"{type(context[bad[0]]).__name__}, not a {{'role', 'content'}} dict")
            text = self.tokenizer.apply_chat_template(list(context), tokenize=False, add_generation_prompt=True)
            return self.encoder.encode(text)
        return self.validate_ids(context, "context")

    def validate_ids(self, token_ids, what: str = "token_ids") -> np.ndarray:
        """The public boundary's check of token ids (see :func:`patchkv_agent.core.inputs.as_token_ids`).

        Args:
            token_ids: a list of ints, a 1-D integer array or tensor.
            what: the argument's name in messages.

        Returns:
            A fresh int64 ``[n]`` array.

        Raises:
            InvalidInput: floats, bools, strings, NaN, values beyond int64, nested or ragged lists, not
                1-D, empty, outside ``[0, vocab_size)``, or longer than the model's maximum positions.
        """
        return as_token_ids(token_ids, vocab_size=self.spec.vocab_size, max_positions=self.spec.max_positions,
                            what=what)

    _validate_ids = validate_ids

    def validate_max_new_tokens(self, max_new_tokens, context_len: int) -> int:
        """``max_new_tokens`` checked and clipped to the positions the model has left after the context.

        Raises:
            InvalidInput: not a non-negative int (``-1``, ``2.5``, ``"3"``, ``None``), or ``> 0`` when the
                context already fills the model's positions.
        """
        return check_max_new_tokens(max_new_tokens, context_len=context_len, max_positions=self.spec.max_positions)

    # ------------------------------------------------------- weights identity

    def refresh_fingerprint(self) -> str:
        """The model's current weights+tokenizer fingerprint.

        Cheap when nothing changed (the parameters' version counters and storages are compared with the
        last look); after an in-place change the fingerprint is recomputed (one pass over the weights)
        and ``spec.fingerprint`` updated. Checkpoints carrying an earlier fingerprint of this engine's
        model then resume exactly, with a ``WEIGHTS_CHANGED`` fallback.

        Returns:
            ``spec.fingerprint`` after the check.
        """
        with self.forward_lock:
            version = self.runner.weights_version()
            if version != self._weights_seen:
                self._weights_seen = version
                fp = fingerprint(self.model, self.tokenizer)
                if fp != self.spec.fingerprint:
                    self._past_fingerprints.add(self.spec.fingerprint)
                    self.spec = replace(self.spec, fingerprint=fp)
            return self.spec.fingerprint

    def weights_changed_since(self, fingerprint_: str) -> bool:
        """True when ``fingerprint_`` was this engine's model's fingerprint before its weights changed."""
        return fingerprint_ != self.refresh_fingerprint() and fingerprint_ in self._past_fingerprints

    def _validate_checkpoint(self, ckpt: Checkpoint) -> Fallback | None:
        """None for a checkpoint of the current weights; a ``WEIGHTS_CHANGED`` fallback for one of this
        model before an in-place change; raises for anything else."""
        return identity_fallback(ckpt, self.refresh_fingerprint(), self._past_fingerprints)

    # ----------------------------------------------------------- checkpoint

    def _capture(self):
        """The model's attention capture for this engine's window, reset (call under ``forward_lock``)."""
        return self.runner.capture(self.settings.capture_window)

    def checkpoint(self, token_ids) -> Checkpoint:
        """Checkpoint-creation pass: prefill with attention statistics, offload every layer's KV to CPU.

        Holds :attr:`forward_lock` for the pass.

        Args:
            token_ids: list of ints or 1-D integer tensor.

        Returns:
            A :class:`Checkpoint` carrying this model's (current) fingerprint.

        Raises:
            InvalidInput: (a ``ValueError``) bad ids: see :meth:`validate_ids`.
        """
        ids = self.validate_ids(token_ids)
        with self.forward_lock:
            fp = self.refresh_fingerprint()
            t0 = time.perf_counter()
            cap = self._capture()
            ids_t = torch.from_numpy(ids)
            if cap is None:
                out = execute(self.runner, self.spec, ids_t, FullRecompute(new_len=len(ids)))
                scores = None
            else:
                with cap:
                    out = execute(self.runner, self.spec, ids_t, FullRecompute(new_len=len(ids)))
                scores = cap.scores()
            ckpt = offload(ids, out.keys, out.values, scores, fp, self.settings)
        t1 = time.perf_counter()
        words = self._words_for(ids, None)  # once per version: resumes carry them on
        prov = ckpt.provenance.replace(words_s=time.perf_counter() - t1, offload_s=time.perf_counter() - t0,
                                       prefill_s=out.stats.recompute_s, stats_s=getattr(cap, "elapsed_s", None),
                                       source=Source.PREFILL)
        return replace(ckpt, words=words, provenance=prov)

    def _words_for(self, ids: np.ndarray, words: np.ndarray | None) -> np.ndarray | None:
        """Word ids of ``ids`` from ``words`` (those of ``ids[:len(words)]``): as they are, extended over
        appended tokens (decoded tokens a runtime added) by mapping only the words at the seam, or mapped
        whole when unknown. None without a tokenizer."""
        if self.words is None:
            return None
        n = len(ids)
        if words is None or len(words) > n:
            return self.words(ids)
        if len(words) == n:
            return words
        m = len(words)
        return self.words.carry_runs(ids, words, [(0, 0, m)], [(m, n)])

    @torch.no_grad()
    def checkpoint_from(self, result: ResumeResult) -> Checkpoint:
        """Offload a resumed state as the base version for the next edit of its thread.

        The attention statistics are those the resume took during its own forward (``result.scores``), so
        no forward runs and :attr:`forward_lock` is not taken: the offload is quantization and copies only,
        and it never delays another caller's forward. A result without statistics (e.g. one built by hand)
        gets them by rerunning its last ``capture_window`` positions over its KV, under the forward lock.
        The checkpoint carries the fingerprint ``result`` was computed under, so a checkpoint of a result
        from before a weight change resumes exactly.

        Args:
            result: a :class:`ResumeResult` of this engine.

        Returns:
            A :class:`Checkpoint` of ``result.context_ids``; its ``provenance`` has ``source``
            (``Source.RESUME``), ``exact_rows``, ``offload_s``, ``stats_s`` (0.0 when the resume's statistics
            were reused), ``quantize_s`` (with mixed runs split into ``value_residual_s``, ``key_residual_s``,
            ``tags_s``, ``pack_s``) and ``copy_s``.
        """
        ids = result.context_ids
        n = len(ids)
        scores = scores_for(result)
        t0 = time.perf_counter()
        stats_s = 0.0
        if scores is None or result.fingerprint is None:
            with self.forward_lock:
                fp = result.fingerprint or self.refresh_fingerprint()
                if scores is None:
                    cap = self._capture()
                    if cap is not None:
                        w = min(self.settings.capture_window, n)
                        plan = FullRecompute(new_len=n, prefix_len=n - w)
                        with cap:  # execute writes into fresh tensors: result's K/V stay as they were
                            execute(self.runner, self.spec, torch.from_numpy(ids), plan, stored_layout(result.keys),
                                    stored_layout(result.values))
                        scores = cap.scores()
                    stats_s = time.perf_counter() - t0
        else:
            fp = result.fingerprint
        ckpt = replace(offload(ids, result.keys, result.values, scores, fp, self.settings),
                       words=self._words_for(ids, result.words))
        prov = ckpt.provenance.replace(offload_s=time.perf_counter() - t0, stats_s=stats_s, source=Source.RESUME,
                                       exact_rows=result.exact_rows)
        return replace(ckpt, provenance=prov)

    @torch.no_grad()
    def heal(self, result: ResumeResult) -> ResumeResult:
        """Recompute exactly the rows a selective resume approximated, so the next call builds on exact KV.

        A selective resume restores rows computed while the old context was in view; every row after the
        first restored one (recomputed rows and decoded tokens included) attended to them. Healing runs
        one forward over ``result.exact_rows ..`` end, attending to the exact rows before it, under
        :attr:`forward_lock` (an agent loop runs it while a tool runs, when the model is idle), and takes
        fresh attention statistics for the next checkpoint. ``result`` itself is not modified.

        Args:
            result: a :class:`ResumeResult` of this engine (a runtime's resident state: context plus decoded
                tokens).

        Returns:
            ``result`` itself when nothing is approximate; otherwise a copy whose K/V equal a full prefill of
            its ids (to fp tolerance), ``exact_rows`` = all rows, and ``stats.heal_s`` /
            ``stats.healed_rows`` recorded in its engine part (the resume's own stats are not changed).
        """
        if not result.approx_rows:
            return result
        n = int(result.keys[0].shape[-2])
        ids = np.asarray(result.context_ids, dtype=np.int64)[:n]
        start = max(0, int(result.exact_rows))
        t0 = time.perf_counter()
        with self.forward_lock:
            cap = self._capture()
            plan = FullRecompute(new_len=n, prefix_len=start)
            with cap if cap is not None else contextlib.nullcontext():
                out = execute(self.runner, self.spec, torch.from_numpy(ids), plan, stored_layout(result.keys),
                              stored_layout(result.values))
            scores = cap.scores() if cap is not None and cap.n_records else None
        dt = time.perf_counter() - t0
        stats = result.stats.with_engine(heal_s=dt, healed_rows=n - start)
        return replace(result, keys=out.keys, values=out.values, exact_rows=n, stats=stats,
                       scores=scores[:n] if scores is not None and len(scores) >= n else result.scores)

    def prepare(self, base: ResumeResult | None, token_ids, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                should_stop=None) -> ResumeResult:
        """The exact KV of a predicted context, computed in background chunks (:mod:`patchkv_agent.core.prepare`).

        The leading rows ``token_ids`` shares with ``base``'s exact rows are copied; the rest is recomputed
        ``chunk_tokens`` rows per forward, each forward holding :attr:`forward_lock` in background mode (a
        foreground resume waits for one chunk at most). Meant for a worker thread while a tool runs.

        Args:
            base: the thread's resident state (None, or one of other weights: everything is recomputed).
            token_ids: the predicted context's ids.
            chunk_tokens: rows per forward.
            should_stop: checked between chunks; True returns the rows finished so far.

        Returns:
            A :class:`ResumeResult` (``strategy`` ``"prepared"``, no decode) whose ``context_ids`` are the
            prepared ids (fewer when stopped) and whose K/V equal a full prefill of them;
            ``stats.prepare`` (a :class:`~patchkv_agent.results.PrepareStats`) has ``reused_rows``,
            ``computed_rows``, ``chunks``, ``stopped``, ``forward_s``.

        Raises:
            InvalidInput: bad ids.
        """
        ids = self.validate_ids(token_ids)
        reuse = 0
        if base is not None and base.fingerprint == self.refresh_fingerprint() and len(base.keys):
            held = min(len(base.context_ids), int(base.keys[0].shape[-2]))
            exact = held if base.exact_rows is None else min(held, int(base.exact_rows))
            m = min(exact, len(ids) - 1)
            neq = np.flatnonzero(np.asarray(base.context_ids[:m]) != ids[:m])
            reuse = int(neq[0]) if len(neq) else m
        prep = prepare_exact(self.runner, self.spec, ids, base_keys=base.keys if reuse else None,
                             base_values=base.values if reuse else None, reuse_rows=reuse, chunk_tokens=chunk_tokens,
                             should_stop=should_stop, capture_window=self.settings.capture_window)
        done = len(prep.token_ids)
        work = PrepareStats(reused_rows=prep.reused_rows, computed_rows=prep.computed_rows, chunks=prep.chunks,
                            stopped=prep.stopped, forward_s=prep.forward_s)
        stats = ResumeStats(EnginePart(
            strategy="prepared", prompt_tokens=done, prefix_tokens=prep.reused_rows, new_tokens=0, suffix_tokens=0,
            recompute_tokens=prep.computed_rows, recompute_ratio=prep.computed_rows / max(1, done - prep.reused_rows),
            restore_tokens=0, payload_bytes=0, ttft_s=prep.elapsed_s, plan_s=0.0, restore_s=0.0,
            recompute_s=prep.forward_s, offload_s=None, stats_s=None, quantize_s=None, fallback=None, prepare=work))
        return ResumeResult(logits=prep.logits, output_ids=[], cache=None, stats=stats, context_ids=prep.token_ids,
                            keys=prep.keys, values=prep.values, fingerprint=self.spec.fingerprint,
                            scores=prep.scores, exact_rows=done)

    def planned_recompute(self, base: Checkpoint | ResumeResult, new_token_ids,
                          strategy: str | Strategy = "patchkv") -> int:
        """How many rows a resume of ``new_token_ids`` from ``base`` would recompute (:meth:`planned`'s count).

        Raises:
            InvalidInput, ValueError: as :meth:`resume`.
        """
        return self.planned(base, self.request(new_token_ids, strategy, 0))[0]

    def planned(self, base: Checkpoint | ResumeResult, request: ResumeRequest) -> tuple[int, Edit]:
        """The rows a resume of ``request`` from ``base`` would recompute, and the diff it plans with (its diff
        and plan only, no forward): a request that carries that diff (``dataclasses.replace(request, edit=e)``)
        resumes from ``base`` without diffing again.

        Args:
            base: a checkpoint, or a resident :class:`ResumeResult` of this engine.
            request: a request from :meth:`request` (its diff is reused when it is of ``base``'s ids).

        Returns:
            ``(recomputed rows, the diff of base's ids into the request's)``.
        """
        ckpt = self.as_checkpoint(base) if isinstance(base, ResumeResult) else base
        edit = request.edit_from(ckpt.token_ids) or diff_versions(ckpt.token_ids, request.ids, words=self.words,
                                                                  old_words=ckpt.words)
        return int(len(request.strategy.plan(self.settings, ckpt, edit).recompute_positions)), edit

    def as_checkpoint(self, result: ResumeResult) -> Checkpoint:
        """A zero-copy checkpoint view of a resident result (full precision, no mixed-precision runs).

        Resuming from it skips the offload entirely (the KV never left the device); ``patchkv`` then
        restores at full precision, with the statistics the resume took (``result.scores``) for its
        attention blocks.

        Args:
            result: a :class:`ResumeResult` of this engine.

        Returns:
            A :class:`Checkpoint` sharing ``result``'s K/V tensors; do not mutate them while it is used.
        """
        words = self._words_for(np.asarray(result.context_ids, dtype=np.int64), result.words)
        return resident_checkpoint(result, self.spec.fingerprint, words)

    # ---------------------------------------------------------------- resume

    @staticmethod
    def strategy(strategy: str | Strategy = "patchkv", options: dict | None = None) -> Strategy:
        """The :class:`Strategy` for a name and its options (:func:`~patchkv_agent.strategies.get_strategy`),
        or an instance as it is: what :meth:`resume` runs (callers above the engine check one before any I/O).

        Raises:
            ValueError: an unknown strategy name or option.
        """
        return get_strategy(strategy, options)

    def request(self, new_token_ids, strategy: str | Strategy = "patchkv", max_new_tokens: int = 16, *,
                edit: Edit | None = None) -> ResumeRequest:
        """Validate and resolve one resume once: what :meth:`resume_request` (and the layers above the engine:
        the thread registry, the store tiers) run without checking again.

        Args:
            new_token_ids: ids of ``C_new`` (list of ints or 1-D integer tensor).
            strategy: a strategy name or a :class:`Strategy` built with options (see :meth:`resume`).
            max_new_tokens: greedy tokens to decode, clipped to the positions the model has left.
            edit: a diff into ``new_token_ids`` already computed (reused when its old side is the base's ids).

        Returns:
            The :class:`~patchkv_agent.resume.ResumeRequest` (owning a copy of the ids).

        Raises:
            InvalidInput: (a ``ValueError``) bad ids or ``max_new_tokens``.
            ValueError: an unknown strategy name or option.
        """
        strat = get_strategy(strategy)  # an unknown name raises before the ids are copied
        new = self.validate_ids(new_token_ids, "new_token_ids")
        return ResumeRequest(ids=new, strategy=strat, edit=edit, checked_for=self.spec.fingerprint,
                             max_new_tokens=self.validate_max_new_tokens(max_new_tokens, len(new)))

    def resume(self, ckpt: Checkpoint | None, new_token_ids, strategy: str | Strategy = "patchkv",
               max_new_tokens: int = 16) -> ResumeResult:
        """Recover the KV of an edited context from a checkpoint and decode greedily.

        Holds :attr:`forward_lock` from the checkpoint check to the last decoded token.

        Args:
            ckpt: the checkpoint of the previous version (may be None for ``exact``), or a resident
                :class:`ResumeResult` of this engine (resumed from without an offload pass).
            new_token_ids: ids of ``C_new`` (list of ints or 1-D integer tensor).
            strategy: ``exact``, ``prefix``, ``direct``, ``patchkv``, ``cacheblend``, or a :class:`Strategy`
                built with options (``PatchKVStrategy(kappa=0.1)``, ``DirectStrategy(precision="mixed")``;
                ``engine.strategy("patchkv", {"kappa": 0.1})`` from a name and a mapping).
            max_new_tokens: greedy tokens to decode (0: only the first-token logits); clipped to the
                positions the model has left after ``C_new``.

        Returns:
            A :class:`ResumeResult`. A checkpoint written before this model's weights changed in place
            gives the exact result with a ``WEIGHTS_CHANGED`` fallback.

        Raises:
            InvalidInput: (a ``ValueError``) bad ids or ``max_new_tokens``.
            ValueError: a checkpoint of another model, or an unknown strategy.
        """
        return self.resume_request(ckpt, self.request(new_token_ids, strategy, max_new_tokens))

    def resume_request(self, ckpt: Checkpoint | ResumeResult | None, request: ResumeRequest) -> ResumeResult:
        """:meth:`resume` of a request built by :meth:`request` (nothing is validated again; a request built by
        hand or by an engine of another model is validated here first).

        Args:
            ckpt: as for :meth:`resume`.
            request: a :class:`~patchkv_agent.resume.ResumeRequest` from :meth:`request`.

        Returns:
            A :class:`ResumeResult` (as :meth:`resume`).

        Raises:
            TypeError: ``request`` is not a :class:`~patchkv_agent.resume.ResumeRequest`.
            InvalidInput: (a ``ValueError``) a request not validated by this model's engine, with bad ids or
                ``max_new_tokens``.
            ValueError: a checkpoint of another model, or a strategy that needs a checkpoint without one.
        """
        if not isinstance(request, ResumeRequest):
            raise TypeError(f"request must be a ResumeRequest from engine.request(...), got {type(request).__name__}")
        if request.checked_for != self.spec.fingerprint:
            request = self.request(request.ids, request.strategy, request.max_new_tokens, edit=request.edit)
        if isinstance(ckpt, ResumeResult):
            ckpt = self.as_checkpoint(ckpt)
        if ckpt is None and request.strategy.uses_checkpoint:
            raise ValueError(f"strategy {request.strategy.name!r} needs a checkpoint; pass one from "
                             "engine.checkpoint()")
        with self.forward_lock:
            fallback = self._validate_checkpoint(ckpt) if ckpt is not None else None
            if fallback is not None:  # stale weights: nothing of the checkpoint is used
                ckpt, request = None, request.as_full_prefill()
            return run_resume(self.runner, self.spec, self.settings, request, ckpt, words=self.words,
                              eos_ids=self.eos_ids, fallback=fallback)


_SETTINGS_FIELDS = frozenset(RecoverySettings.field_names())


"""Frozen per-model calibration profiles: find and load them as :class:`Profile` values.

A profile is one JSON file written by ``patchkv-agent calibrate`` (``patchkv_agent.calibration``):
model name and fingerprint, the dirty-window :class:`~patchkv_agent.core.plan.LengthModel`, ``kappa``,
``block_size``, the reader signal, the precision policy and the provenance of all of it. See
``docs/calibration.md``. Loaded, it is a frozen :class:`Profile`; :meth:`Profile.settings` turns it into
the engine's :class:`~patchkv_agent.core.settings.RecoverySettings`.

Search path (:func:`profile_dirs`), first match wins within each pass: the folders the caller hands
down (``PatchKVEngine(..., profile_dirs=...)``), ``$PATCHKV_PROFILE_DIR`` (``os.pathsep``-separated
folders), ``<user cache>/profiles`` (where ``calibrate`` writes by default), then the profiles this
package ships (:data:`SHIPPED_PROFILE_DIR`, ``patchkv_agent/profiles/shipped/``). Matching: first by
model fingerprint (exact), then by model name (the name the model was loaded by, e.g.
``"smollm2-135m"``); a name-only match whose fingerprint differs is returned with a warning (e.g. the
same weights under another transformers version change the config part of the fingerprint).

A profile file is input from outside the process: every field is type- and range-checked and a bad
one raises ``ValueError`` naming the file and the fix; nothing in it is executed. A file is read only when
it is a regular file (a link to one is fine; a FIFO, device or directory is not opened for reading, and
the open never blocks) of at most :data:`PROFILE_MAX_BYTES`, UTF-8 JSON nested at most
:data:`PROFILE_MAX_DEPTH` deep. The search (``profile="auto"``) skips every other file, and every file
whose fields are out of range, with a warning naming it, so junk in a profile folder can neither break
nor hang building an engine; an explicit path (:func:`read_profile`) raises ``ValueError`` instead.

Boundary: reads JSON files and builds settings values; knows nothing about models beyond
``ModelSpec.fingerprint`` and the engine's ``source``, and nothing about how profiles are made (the
calibration package, above the engine, writes them).
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from ..core.length_model import LengthModel
from ..core.settings import RecoverySettings

if TYPE_CHECKING:
    from ..core.precision import PrecisionPolicy

__all__ = ["PROFILE_SCHEMA", "SHIPPED_PROFILE_DIR", "READER_RULE_KEYS", "PROFILE_FIELDS", "PROFILE_MAX_BYTES", "PROFILE_MAX_DEPTH",
           "Profile", "profile_dirs", "iter_profiles", "load_profile", "is_profile", "read_profile",
           "resolve_profile_arg"]

log = logging.getLogger(__name__)

PROFILE_SCHEMA = 1
_REQUIRED = ("schema", "model", "fingerprint", "length_model", "kappa", "block_size")
SHIPPED_PROFILE_DIR = Path(__file__).resolve().parent / "shipped"
_POLICY_FIELDS = ("alpha", "tau_L", "tau_H", "g4", "tau_LL", "g4k")
PROFILE_MAX_BYTES = 16 << 20  # a calibration profile with its labels and tables is well under 1 MiB
PROFILE_MAX_DEPTH = 64  # nesting of JSON containers (calibrate writes < 10)
_MAX_TOKENS = (1 << 31) - 1  # token counts (block_size, recent_window): the kernels' int32 fields
_MAX_THRESHOLD = 1e9  # precision thresholds and bounds (risk scores are attention x residual, O(10))


@dataclass(frozen=True, kw_only=True)
class Profile:
    """One calibration profile, validated and frozen.

    The recovery settings it sets are :attr:`overrides`, checked by the one schema,
    :class:`~patchkv_agent.core.settings.RecoverySettings` (their meaning, defaults and ranges are
    documented there); each also reads as an attribute (``profile.kappa``, ``profile.recent_window``:
    None when this profile leaves the field to the base settings, e.g. an older profile).

    Attributes:
        model: the model name it was calibrated for (what name matching compares).
        fingerprint: the weights+tokenizer fingerprint it was calibrated on.
        overrides: the settings fields it sets, read-only: always ``length_model``, ``kappa`` and
            ``block_size``; the planner fields a calibration chose (:data:`PROFILE_FIELDS` at the file's top
            level, the reader constants from its ``reader_rule`` object: keys ``min_share``, ``min_blocks``,
            ``attention_blocks``, ``budget``, each optional); ``precision_policy`` when calibrated.
        path: the file it was read from (None: built from a dict).
        match: how it was found: ``"fingerprint"``, ``"name"``, ``"explicit"`` (a path) or ``"given"``.
        data: the whole JSON object, read-only (provenance, selection tables).
    """

    model: str
    fingerprint: str
    overrides: Mapping[str, Any]
    path: str | None = None
    match: str = "given"
    data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getattr__(self, name: str) -> Any:
        if name in _SETTING_NAMES:  # a settings field this profile leaves to the base: None
            return self.__dict__.get("overrides", {}).get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def reader_rule(self) -> Mapping[str, Any]:
        """The reader rule's constants this profile sets, as settings fields (empty: none)."""
        return MappingProxyType({k: v for k, v in self.overrides.items() if k in READER_RULE_KEYS.values()})

    @classmethod
    def from_dict(cls, data: Any, *, path: str | Path | None = None, match: str = "given") -> "Profile":
        """Validate a profile's JSON object.

        Args:
            data: the JSON object.
            path: the file it came from (named in messages).
            match: how it was found.

        Returns:
            The profile.

        Raises:
            ValueError: a missing key or a field of the wrong type or range (the message names the file).
        """
        where = f"profile {path}" if path is not None else "profile"
        if not is_profile(data):
            missing = [k for k in _REQUIRED if not isinstance(data, dict) or k not in data]
            raise ValueError(f"{where} is not a calibration profile (missing {missing}); pass a JSON written by "
                             "'patchkv-agent calibrate'")
        try:
            lm = data["length_model"]
            if not isinstance(lm, dict):
                raise ValueError("'length_model' is not an object")
            schema = data["schema"]
            if isinstance(schema, bool) or not isinstance(schema, int) or not 1 <= schema <= PROFILE_SCHEMA:
                raise ValueError(f"schema={_short(schema)} (this package reads schema 1..{PROFILE_SCHEMA})")
            for k in ("model", "fingerprint"):
                if not isinstance(data[k], str):
                    raise ValueError(f"{k}={_short(data[k])} (need a string)")
            fields = {"length_model": LengthModel.from_dict(lm), "kappa": data["kappa"], "block_size": data["block_size"]}
            fields.update({k: data[k] for k in PROFILE_FIELDS if data.get(k) is not None})
            fields.update(_reader_rule(data.get("reader_rule")))
            policy = _policy(data.get("precision_policy"))
            if policy is not None:
                fields["precision_policy"] = policy
            checked = RecoverySettings().replace(**fields)  # the one type and range check of every field
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as e:
            raise ValueError(f"{where} is malformed: {str(e)[:300]}; recalibrate with 'patchkv-agent calibrate'") from None
        return cls(model=data["model"], fingerprint=data["fingerprint"],
                   overrides=MappingProxyType({k: getattr(checked, k) for k in fields}),
                   path=None if path is None else str(path), match=match, data=MappingProxyType(dict(data)))

    def fields(self) -> dict[str, Any]:
        """The :class:`~patchkv_agent.core.settings.RecoverySettings` fields this profile sets (:attr:`overrides`)."""
        return dict(self.overrides)

    def settings(self, base: "RecoverySettings | None" = None) -> "RecoverySettings":
        """``base`` (default: the built-in defaults) with this profile's fields."""
        return (base if base is not None else RecoverySettings()).replace(**self.overrides)


READER_RULE_KEYS = {"min_share": "reader_min_share", "min_blocks": "reader_min_blocks",
                    "attention_blocks": "reader_attention_blocks", "budget": "reader_budget"}
"""A profile's ``reader_rule`` keys and the :class:`~patchkv_agent.core.settings.RecoverySettings` fields they set."""


_SETTING_NAMES = frozenset(RecoverySettings.field_names())
PROFILE_FIELDS = tuple(k for k in RecoverySettings.field_names(strategy=True)
                       if k not in ("length_model", "kappa", "block_size", *READER_RULE_KEYS.values()))
"""Settings fields a profile may set at its top level (the planner's, a strategy's options, less those the file
writes in its own form); absent in older profiles: the base settings' own are kept."""


def _short(v: Any) -> str:
    """``repr(v)`` cut to 40 characters (a hostile value may be huge)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1 << 64:
        return f"<an int of {v.bit_length()} bits>"
    return repr(v)[:40]


def _share(v: Any) -> bool:
    """A number in [0, 1] (not a bool); never converts a huge int to float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return 0 <= v <= 1 and (isinstance(v, int) or math.isfinite(v))


def _reader_rule(rule: Any) -> dict[str, Any]:
    """A profile's ``reader_rule`` object as settings fields (absent: none; the settings check their values)."""
    if rule is None:
        return {}
    if not isinstance(rule, dict):
        raise ValueError("'reader_rule' is not an object")
    unknown = sorted(set(rule) - set(READER_RULE_KEYS))
    if unknown:
        raise ValueError(f"reader_rule has unknown keys {unknown} (known: {sorted(READER_RULE_KEYS)})")
    return {name: rule[key] for key, name in READER_RULE_KEYS.items() if rule.get(key) is not None}


def _policy(pol: Any) -> "PrecisionPolicy | None":
    if pol is None:
        return None
    if not isinstance(pol, dict):
        raise ValueError("'precision_policy' is not an object")
    if not pol.get("calibrated", True):  # uncalibrated entries keep the defaults
        return None
    from ..core.precision import PrecisionPolicy

    # fields a profile lacks (e.g. tau_LL and g4k in profiles written before K4V4) take the defaults
    vals = {}
    for k in _POLICY_FIELDS:
        v = pol.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= _MAX_THRESHOLD or (
                isinstance(v, float) and not math.isfinite(v)):
            raise ValueError(f"precision_policy.{k}={_short(v)} (need a number in [0, {_MAX_THRESHOLD:g}])")
        vals[k] = float(v)
    return PrecisionPolicy(**vals)


def profile_dirs(extra: Sequence[str | Path] = ()) -> list[Path]:
    """Folders searched for profiles, in order (see the module docstring).

    Args:
        extra: folders handed down by the caller, searched first.
    Returns:
        Existing and non-existing folders alike; callers skip missing ones.
    """
    dirs = [Path(p) for p in extra]
    dirs += [Path(p) for p in os.environ.get("PATCHKV_PROFILE_DIR", "").split(os.pathsep) if p]
    from ..loading import cache_dir

    dirs.append(cache_dir() / "profiles")
    dirs.append(SHIPPED_PROFILE_DIR)
    return dirs


def is_profile(data: Any) -> bool:
    """True when ``data`` looks like a calibration profile (a dict with the required keys)."""
    return isinstance(data, dict) and all(k in data for k in _REQUIRED)


def read_profile(path: str | Path) -> Profile:
    """Read one profile file (e.g. a draft, or one for another machine).

    Args:
        path: a profile JSON written by ``patchkv-agent calibrate``.
    Returns:
        The :class:`Profile` (``match="explicit"``).
    Raises:
        ValueError: the file cannot be read, is not a regular file (a FIFO, device or directory), is larger
            than :data:`PROFILE_MAX_BYTES`, is not UTF-8 JSON (or nests deeper than
            :data:`PROFILE_MAX_DEPTH`), lacks the profile keys or has a field of the wrong type or range.
    """
    p = Path(path)
    return Profile.from_dict(_read_json(p), path=p, match="explicit")


def _read_json(p: Path) -> Any:
    """The JSON value of profile file ``p``, read without blocking and without reading past the size cap.

    Raises:
        ValueError: naming the file, what is wrong with it and the fix.
    """
    fix = "pass a JSON written by 'patchkv-agent calibrate'"
    try:
        st = os.stat(p)  # follows a link: what it names must be a regular file too
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"profile {p} is not a regular file (a FIFO, device or directory); remove it or {fix}")
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
        try:
            st = os.fstat(fd)  # what was opened (the path may have been swapped since the stat)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"profile {p} is not a regular file (a FIFO, device or directory); remove it or {fix}")
            if st.st_size > PROFILE_MAX_BYTES:
                raise ValueError(f"profile {p} has {st.st_size} bytes, more than a profile holds "
                                 f"({PROFILE_MAX_BYTES}); remove it or {fix}")
            chunks, n = [], 0
            while n <= PROFILE_MAX_BYTES and (chunk := os.read(fd, min(1 << 20, PROFILE_MAX_BYTES + 1 - n))):
                chunks.append(chunk)
                n += len(chunk)
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"cannot read profile {p}: {e}; {fix}") from None
    if n > PROFILE_MAX_BYTES:
        raise ValueError(f"profile {p} grew past {PROFILE_MAX_BYTES} bytes while read; remove it or {fix}")
    try:
        data = json.loads(b"".join(chunks).decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"profile {p} is not UTF-8 text ({e.reason} at byte {e.start}); {fix}") from None
    except RecursionError:
        raise ValueError(f"profile {p} nests deeper than JSON can be read; {fix}") from None
    except ValueError as e:  # JSONDecodeError, an int literal of too many digits
        raise ValueError(f"profile {p} is not JSON ({str(e)[:200]}); {fix}") from None
    if not _shallow(data, PROFILE_MAX_DEPTH):
        raise ValueError(f"profile {p} nests deeper than {PROFILE_MAX_DEPTH} levels; {fix}")
    return data


def _shallow(value: Any, limit: int) -> bool:
    """Whether ``value``'s containers nest at most ``limit`` deep (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return False
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def resolve_profile_arg(spec: str | None) -> "str | Profile | None":
    """A command line's ``--profile`` value as the engine's ``profile=`` argument.

    Args:
        spec: ``"auto"`` (or None), ``"none"``, or a path to a profile JSON.
    Returns:
        ``"auto"``, None, or the :class:`Profile`.
    Raises:
        ValueError: an unreadable path or a file that is not a profile (see :func:`read_profile`).
    """
    if spec in (None, "auto"):
        return "auto"
    if spec == "none":
        return None
    return read_profile(spec)


def iter_profiles(dirs: Sequence[str | Path] | None = None) -> Iterator[tuple[Path, dict]]:
    """Every readable profile in the search path, in search order.

    Files that cannot be read as profiles (not regular files, larger than :data:`PROFILE_MAX_BYTES`, not
    UTF-8 JSON, nested too deep) are skipped with a warning naming the file; JSON files that are not
    profiles are skipped silently. The fields are checked by :meth:`Profile.from_dict` (see
    :func:`load_profile`).

    Args:
        dirs: folders to search instead of :func:`profile_dirs`.
    Yields:
        ``(path, profile dict)``.
    """
    for d in profile_dirs() if dirs is None else dirs:
        d = Path(d)
        try:
            if not d.is_dir():
                continue
            paths = sorted(d.glob("*.json"))
        except OSError as e:
            log.warning("skipping profile folder %s: %s", d, e)
            continue
        for path in paths:
            try:
                data = _read_json(path)
            except ValueError as e:
                log.warning("skipping profile file %s: %s", path, e)
                continue
            if is_profile(data):
                yield path, data


def _key(spec_or_fingerprint: Any) -> tuple[str | None, str | None]:
    """(fingerprint, model name) from an engine, a ModelSpec, a model, or a string."""
    obj = spec_or_fingerprint
    if isinstance(obj, str):
        return (obj, None) if ":" in obj else (None, obj)
    name = getattr(obj, "source", None)  # an engine: the name its model was loaded by
    spec = getattr(obj, "spec", obj)
    return getattr(spec, "fingerprint", None), name


def _names(name: str) -> set[str]:
    base = os.path.basename(str(name).rstrip("/"))
    stem = base[:-5] if base.endswith(".gguf") else base
    return {str(name), base, stem}


def load_profile(spec_or_fingerprint: Any, *, model_name: str | None = None,
                 dirs: Sequence[str | Path] | None = None) -> Profile | None:
    """The calibration profile of a model, or None when there is none.

    Args:
        spec_or_fingerprint: a :class:`~patchkv_agent.engine.PatchKVEngine`, a
            :class:`~patchkv_agent.core.models.ModelSpec`, a fingerprint string (``"<model_type>:<hex>"``) or a
            model name (e.g. ``"smollm2-135m"``, an HF id or a path).
        model_name: name to fall back on when no profile matches the fingerprint (default: the name the
            engine's model was loaded by, if known).
        dirs: folders to search instead of :func:`profile_dirs`.
    Returns:
        The :class:`Profile` (``match`` is ``"fingerprint"`` or ``"name"``), or None. A matching file with a
        field of the wrong type or range is skipped with a warning naming the file and the field, and the
        search goes on (a file that is not a profile is skipped silently).
    """
    fp, name = _key(spec_or_fingerprint)
    name = model_name or name
    found = list(iter_profiles(dirs))

    def valid(path: Path, data: dict, match: str) -> Profile | None:
        try:
            return Profile.from_dict(data, path=path, match=match)
        except ValueError as e:
            log.warning("skipping profile file %s: %s", path, e)
            return None

    if fp:
        for path, data in found:
            if data.get("fingerprint") == fp and (prof := valid(path, data, "fingerprint")) is not None:
                return prof
    if name:
        wanted = _names(name)
        for path, data in found:
            if isinstance(data.get("model"), str) and _names(data["model"]) & wanted:
                prof = valid(path, data, "name")
                if prof is None:
                    continue
                if fp and data.get("fingerprint") != fp:
                    log.warning("profile %s matches model name %r but not its fingerprint (%s != %s); using it",
                                path, name, str(data.get("fingerprint"))[:24], fp[:24])
                return prof
    return None

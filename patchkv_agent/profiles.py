"""Frozen per-model calibration profiles: find, load and apply them.

A profile is one JSON file written by ``patchkv-agent calibrate`` (``patchkv_agent.calibration``):
model name and fingerprint, the dirty-window :class:`~patchkv_agent.core.plan.LengthModel`, ``kappa``,
``block_size``, the precision policy and the provenance of all of it. See ``docs/calibration.md``.

Search path, first match wins within each pass: ``$PATCHKV_PROFILE_DIR`` (``os.pathsep``-separated
folders), ``<user cache>/profiles`` (:func:`patchkv_agent.core.models.cache_dir`), then the profiles shipped in
the package (``calibration/profiles/*.json``). Matching: first by model fingerprint (exact), then by
model name (the name the model was loaded by, e.g. ``"smollm2-135m"``); a name-only match whose
fingerprint differs is returned with a warning (e.g. the same weights under another transformers
version change the config part of the fingerprint).

Boundary: reads JSON files and turns them into :class:`~patchkv_agent.core.settings.RecoverySettings`
(or sets three documented engine attributes); knows nothing about models
beyond ``ModelSpec.fingerprint`` and ``model.patchkv_source``, and nothing about how profiles are made.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .core.plan import LengthModel

if TYPE_CHECKING:
    from .core.settings import RecoverySettings

__all__ = ["PROFILE_SCHEMA", "profile_dirs", "iter_profiles", "load_profile", "profile_length_model",
           "profile_settings", "apply_profile", "is_profile", "read_profile",
           "resolve_profile_arg"]

log = logging.getLogger(__name__)

PROFILE_SCHEMA = 1
_REQUIRED = ("schema", "model", "fingerprint", "length_model", "kappa", "block_size")


def profile_dirs() -> list[Path]:
    """Folders searched for profiles, in order (see the module docstring).

    Returns:
        Existing and non-existing folders alike; callers skip missing ones.
    """
    dirs = [Path(p) for p in os.environ.get("PATCHKV_PROFILE_DIR", "").split(os.pathsep) if p]
    from .core.models import cache_dir

    dirs.append(cache_dir() / "profiles")
    # locate the calibration package's folder without importing it (calibration sits above the engine)
    spec = importlib.util.find_spec("patchkv_agent.calibration")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        dirs.append(Path(loc).resolve() / "profiles")
    return dirs


def is_profile(data: Any) -> bool:
    """True when ``data`` looks like a calibration profile (a dict with the required keys)."""
    return isinstance(data, dict) and all(k in data for k in _REQUIRED)


def read_profile(path: str | Path) -> dict:
    """Read one profile file (e.g. a draft, or one for another machine).

    Args:
        path: a profile JSON written by ``patchkv-agent calibrate``.
    Returns:
        The profile dict, with ``_source`` set to ``{"path": ..., "match": "explicit"}``.
    Raises:
        ValueError: the file cannot be read, is not JSON, or lacks the profile keys.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read profile {p}: {e}; pass a JSON written by 'patchkv-agent calibrate'") from e
    if not is_profile(data):
        missing = [k for k in _REQUIRED if not isinstance(data, dict) or k not in data]
        raise ValueError(f"{p} is not a calibration profile (missing {missing}); pass a JSON written by "
                         "'patchkv-agent calibrate'")
    return {**data, "_source": {"path": str(p), "match": "explicit"}}


def resolve_profile_arg(spec: str | None) -> str | dict | None:
    """A command line's ``--profile`` value as the engine's ``profile=`` argument.

    Args:
        spec: ``"auto"`` (or None), ``"none"``, or a path to a profile JSON.
    Returns:
        ``"auto"``, None, or the profile dict.
    Raises:
        ValueError: an unreadable path or a file that is not a profile (see :func:`read_profile`).
    """
    if spec in (None, "auto"):
        return "auto"
    if spec == "none":
        return None
    return read_profile(spec)


def iter_profiles(dirs: list[Path] | None = None) -> Iterator[tuple[Path, dict]]:
    """Every readable profile in the search path, in search order (unreadable files are logged, skipped).

    Args:
        dirs: folders to search instead of :func:`profile_dirs`.
    Yields:
        ``(path, profile dict)``.
    """
    for d in profile_dirs() if dirs is None else dirs:
        d = Path(d)
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                log.warning("skipping unreadable profile %s: %s", path, e)
                continue
            if is_profile(data):
                yield path, data


def _key(spec_or_fingerprint: Any) -> tuple[str | None, str | None]:
    """(fingerprint, model name) from an engine, a ModelSpec, a model, or a string."""
    obj = spec_or_fingerprint
    if isinstance(obj, str):
        return (obj, None) if ":" in obj else (None, obj)
    name = None
    model = getattr(obj, "model", None)
    if model is not None:
        name = getattr(model, "patchkv_source", None)
    if name is None:
        name = getattr(obj, "patchkv_source", None)
    spec = getattr(obj, "spec", obj)
    return getattr(spec, "fingerprint", None), name


def _names(name: str) -> set[str]:
    base = os.path.basename(str(name).rstrip("/"))
    stem = base[:-5] if base.endswith(".gguf") else base
    return {str(name), base, stem}


def load_profile(spec_or_fingerprint: Any, *, model_name: str | None = None,
                 dirs: list[Path] | None = None) -> dict | None:
    """The calibration profile of a model, or None when there is none.

    Args:
        spec_or_fingerprint: a :class:`~patchkv_agent.engine.PatchKVEngine`, a
            :class:`~patchkv_agent.core.models.ModelSpec`, a fingerprint string (``"<model_type>:<hex>"``) or a
            model name (e.g. ``"smollm2-135m"``, an HF id or a path).
        model_name: name to fall back on when no profile matches the fingerprint (default: the name the
            engine's model was loaded by, if known).
        dirs: folders to search instead of :func:`profile_dirs`.
    Returns:
        A copy of the profile dict plus ``"_source": {"path", "match"}`` (``match`` is ``"fingerprint"``
        or ``"name"``), or None.
    """
    fp, name = _key(spec_or_fingerprint)
    name = model_name or name
    found = list(iter_profiles(dirs))
    if fp:
        for path, data in found:
            if data.get("fingerprint") == fp:
                return {**data, "_source": {"path": str(path), "match": "fingerprint"}}
    if name:
        wanted = _names(name)
        for path, data in found:
            if _names(str(data.get("model", ""))) & wanted:
                if fp and data.get("fingerprint") != fp:
                    log.warning("profile %s matches model name %r but not its fingerprint (%s != %s); using it",
                                path, name, str(data.get("fingerprint"))[:24], fp[:24])
                return {**data, "_source": {"path": str(path), "match": "name"}}
    return None


def profile_length_model(profile: dict) -> LengthModel:
    """The profile's dirty-window length model.

    Args:
        profile: a profile dict.
    Returns:
        The :class:`LengthModel`.
    Raises:
        ValueError: the profile has no valid ``length_model``.
    """
    lm = profile.get("length_model") if isinstance(profile, dict) else None
    if not isinstance(lm, dict):
        raise ValueError("profile has no 'length_model' object")
    return LengthModel.from_dict(lm)


def _planner_fields(profile: dict) -> tuple[LengthModel, float, int]:
    lm = profile_length_model(profile)
    kappa = float(profile["kappa"])
    block = int(profile["block_size"])
    if not 0.0 <= kappa <= 1.0 or block < 1:
        raise ValueError(f"profile has kappa={kappa} (need [0, 1]) and block_size={block} (need >= 1)")
    return lm, kappa, block


def profile_settings(profile: dict, base: "RecoverySettings | None" = None) -> "RecoverySettings":
    """The recovery settings a profile describes: ``base`` with its length model, ``kappa``, block size,
    reader signal (``readers``, when the profile has one) and (when calibrated) precision policy.

    Args:
        profile: a profile dict (e.g. from :func:`load_profile`).
        base: the settings the profile's fields replace (default: the built-in defaults).
    Returns:
        A :class:`~patchkv_agent.core.settings.RecoverySettings`.
    Raises:
        ValueError: the profile is malformed (bad length model, kappa outside ``[0, 1]``, block < 1, an
            unknown ``readers``).
    """
    from .core.precision import PrecisionPolicy
    from .core.settings import RecoverySettings

    lm, kappa, block = _planner_fields(profile)
    change: dict[str, Any] = {"length_model": lm, "kappa": kappa, "block_size": block}
    if "readers" in profile:  # calibrated since the reader stage; older profiles keep the settings' own
        change["readers"] = profile["readers"]
    pol = profile.get("precision_policy")
    if isinstance(pol, dict) and pol.get("calibrated", True):  # uncalibrated entries keep the defaults
        # fields a profile lacks (e.g. tau_LL and g4k in profiles written before K4V4) take the defaults
        change["precision_policy"] = PrecisionPolicy(**{k: float(pol[k]) for k in ("alpha", "tau_L", "tau_H", "g4",
                                                                                   "tau_LL", "g4k")
                                                        if pol.get(k) is not None})
    return (base if base is not None else RecoverySettings()).replace(**change)


def apply_profile(engine: Any, profile: dict) -> None:
    """Set an engine's planner settings from a profile: ``length_model``, ``kappa``, ``block_size`` (and
    ``readers`` on an engine with ``settings``, when the profile has one).

    Also records the profile's path as ``engine.profile_path`` (None when unknown). The precision
    policy is left to the caller (``profile["precision_policy"]``) until the engine quantizes.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine` (any object with those attributes).
        profile: a profile dict (e.g. from :func:`load_profile`).
    Raises:
        ValueError: the profile is malformed (bad length model, kappa outside ``[0, 1]``, block < 1).
    """
    lm, kappa, block = _planner_fields(profile)
    engine.length_model, engine.kappa, engine.block_size = lm, kappa, block
    if "readers" in profile and hasattr(engine, "settings"):
        engine.settings = engine.settings.replace(readers=profile["readers"])
    engine.profile_path = (profile.get("_source") or {}).get("path")

"""Registry of recovery policies: one name, one module, imported only when chosen.

A policy is a frozen dataclass whose fields are its options (with the papers' values as
defaults) and whose ``propose`` answers a failure; its docstring's first line is its summary.
Adding one is its module plus one ``register`` line here.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import Any

from controlplane.recovery.errors import InvalidScenario, UnknownPolicy
from controlplane.recovery.policies.base import Policy


class InvalidOption(InvalidScenario):
    """An option a policy does not take, or a value it cannot take."""

    code = "invalid_option"


@dataclass(frozen=True, slots=True)
class _Entry:
    target: str  # "module:Class"
    preset: tuple[tuple[str, Any], ...]  # options fixed by this name (``odyssey_spares``)
    by_default: bool = True  # asked when a caller names no policies (``default_names``)


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """What the API and the job form show of a policy: name, summary, options and defaults."""

    name: str
    summary: str
    options: dict[str, Any]


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, target: str, *, by_default: bool = True, **preset: Any) -> None:
    """Register a policy class by dotted path; ``preset`` fixes options for this name.
    ``by_default=False``: asked only by name (a policy for one kind of job, not every job).

    A name registered twice is an error.
    """
    if name in _REGISTRY:
        raise ValueError(f"policy {name!r} is already registered as {_REGISTRY[name].target}")
    _REGISTRY[name] = _Entry(target, tuple(preset.items()), by_default)


def names() -> list[str]:
    """Every registered policy."""
    return list(_REGISTRY)


def default_names() -> list[str]:
    """The policies asked when a caller names none: every one but those asked only by name."""
    return [name for name, entry in _REGISTRY.items() if entry.by_default]


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(_REGISTRY)}") from None


def _class(name: str) -> type[Policy]:
    module_name, attribute = _entry(name).target.split(":")
    cls: type[Policy] = getattr(importlib.import_module(module_name), attribute)
    return cls


def option_defaults(name: str) -> dict[str, Any]:
    """The options the named policy takes, with their defaults (its preset ones left out)."""
    cls = _class(name)
    preset = dict(_entry(name).preset)
    if not dataclasses.is_dataclass(cls):
        return {}
    return {
        f.name: f.default
        for f in dataclasses.fields(cls)
        if f.init and f.name not in preset and f.default is not dataclasses.MISSING
    }


def describe(name: str) -> PolicyInfo:
    """Name, one-line summary and options of a registered policy (imports its module)."""
    doc = (_class(name).__doc__ or "").strip()
    return PolicyInfo(
        name=name, summary=doc.splitlines()[0] if doc else "", options=option_defaults(name)
    )


def get(name: str, **options: Any) -> Policy:
    """Instantiate the named policy with ``options``; an unknown name or option is refused.

    The error for an unknown name lists the known ones, and for an unknown option the ones the
    policy takes.
    """
    known = option_defaults(name)
    for key, value in options.items():
        if key not in known:
            raise InvalidOption(
                f"policy {name!r} takes no option {key!r}; it takes: {', '.join(known) or 'none'}",
                field=f"options.{name}.{key}",
            )
        _check_type(name, key, value)
    return _class(name)(**dict(_entry(name).preset), **options)


def _check_type(name: str, key: str, value: Any) -> None:
    """Refuse an option value of the wrong type: a policy's options are bools, ints, finite
    floats (ints accepted) or None where its field allows it."""
    cls = _class(name)
    assert dataclasses.is_dataclass(cls)  # a policy with options is a dataclass
    declared = {f.name: f.type for f in dataclasses.fields(cls)}[key]
    allowed = {t.strip() for t in str(declared).split("|")}
    ok = (
        (value is None and "None" in allowed)
        or (isinstance(value, bool) and "bool" in allowed)
        or (
            not isinstance(value, bool)
            and isinstance(value, int | float)
            and ("float" in allowed or ("int" in allowed and isinstance(value, int)))
            and math.isfinite(value)
        )
    )
    if not ok:
        raise InvalidOption(
            f"policy {name!r} option {key!r} must be {' or '.join(sorted(allowed))}, got {value!r}",
            field=f"options.{name}.{key}",
        )


_P = "controlplane.recovery.policies."
register("odyssey", _P + "odyssey:OdysseyPolicy")
register("rerouting", _P + "rerouting:ReroutingPolicy")
register("dynamic", _P + "dynamic:DynamicPolicy")
register("oobleck", _P + "oobleck:OobleckPolicy")
register("checkfree", _P + "checkfree:CheckFreePolicy")
register("checkfree_plus", _P + "checkfree:CheckFreePlusPolicy")
register("flashrecovery", _P + "flashrecovery:FlashRecoveryPolicy")
register("checkpoint", _P + "checkpoint:CheckpointPolicy")
register("bamboo", _P + "bamboo:BambooPolicy")
register("varuna", _P + "varuna:VarunaPolicy")
# Pitstop's own policies come after the papers' (docs/reproduction/odyssey.md): Odyssey with its
# re-plan allowed onto spares, the fair baseline on a cluster with spares, then pitstop.
register("odyssey_spares", _P + "odyssey:OdysseyPolicy", use_spares=True)
register("pitstop", _P + "pitstop:PitstopPolicy")
# For jobs under the launcher (an unmodified script restarts, it keeps nothing in memory): asked
# by name only, so every other job's decisions, and the reproductions, are what they were.
register("restart", _P + "restart:RestartPolicy", by_default=False)
register("restart_shrink", _P + "restart:RestartPolicy", by_default=False, shrink=True)

__all__ = ["InvalidOption", "Policy", "PolicyInfo", "describe", "get", "names", "register"]

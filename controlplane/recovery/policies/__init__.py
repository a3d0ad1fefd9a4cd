"""Registry of recovery policies: one name, one module, imported only when chosen."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from controlplane.recovery.errors import UnknownPolicy
from controlplane.recovery.policies.base import Policy

PolicyFactory = Callable[..., Policy]

# name -> "module:attribute" of the factory (usually the policy class).
_REGISTRY: dict[str, str] = {}
# name -> keyword options its factory understands (e.g. the planner's exhaustive mode).
_OPTIONS: dict[str, frozenset[str]] = {}


def register(name: str, target: str, *, options: frozenset[str] = frozenset()) -> None:
    """Register a policy factory by dotted path; a name registered twice is an error."""
    if name in _REGISTRY:
        raise ValueError(f"policy {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = target
    _OPTIONS[name] = options


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str, **options: object) -> Policy:
    """Instantiate the named policy; an unknown name's error lists the known ones.

    Options the policy does not understand are dropped, so one set can be passed to all.
    """
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise UnknownPolicy(f"unknown policy {name!r}; known: {', '.join(_REGISTRY)}") from None
    module_name, attribute = target.split(":")
    factory: PolicyFactory = getattr(importlib.import_module(module_name), attribute)
    return factory(**{k: v for k, v in options.items() if k in _OPTIONS[name]})


_P = "controlplane.recovery.policies."
_PLANNING = frozenset({"exhaustive"})
register("odyssey", _P + "odyssey:OdysseyPolicy", options=_PLANNING)
register("rerouting", _P + "rerouting:ReroutingPolicy")
register("dynamic", _P + "dynamic:DynamicPolicy", options=_PLANNING)
for _name, _target in [
    ("oobleck", _P + "oobleck:OobleckPolicy"),
    ("checkfree", _P + "checkfree:CheckFreePolicy"),
    ("checkfree_plus", _P + "checkfree:CheckFreePlusPolicy"),
    ("flashrecovery", _P + "flashrecovery:FlashRecoveryPolicy"),
    ("checkpoint", _P + "checkpoint:CheckpointPolicy"),
    ("bamboo", _P + "bamboo:BambooPolicy"),
    ("varuna", _P + "varuna:VarunaPolicy"),
]:
    register(_name, _target)
# Pitstop's own policies come after the papers' (docs/reproduction/odyssey.md): Odyssey with its
# re-plan allowed onto spares, the fair baseline on a cluster with spares, then pitstop.
register("odyssey_spares", _P + "odyssey:odyssey_with_spares", options=_PLANNING)
register("pitstop", _P + "pitstop:PitstopPolicy", options=_PLANNING)

__all__ = ["Policy", "get", "names", "register"]

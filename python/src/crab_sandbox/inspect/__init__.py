"""Crab in Inspect AI: a sandbox provider and a snapshot strategy.

* :class:`CrabSandboxEnvironment` (``crab_sandbox.inspect.provider``): Inspect's
  ``sandbox="crab"`` / ``sandbox=("crab", "compose.yaml")``, registered through the
  ``inspect_ai`` entry point of this package. Each task gets one base sandbox and a restore
  point of it; each sample is a fork of that point. Needs ``inspect-ai`` (imported only when
  the provider is).
* :class:`CrabSnapshotStrategy` (``crab_sandbox.inspect._strategy``): shaped after Inspect's
  proposed ``SandboxSnapshotStrategy`` Protocol; imports nothing from ``inspect_ai``.

``from crab_sandbox.inspect import CrabSnapshotStrategy`` works without ``inspect_ai``
installed; the provider's names (``CrabSandboxEnvironment``, ``CrabSandboxConfig``) load the
provider module, and with it ``inspect_ai``, on first use.
"""

from __future__ import annotations

from typing import Any

from ._strategy import CrabSnapshotDetails, CrabSnapshotStrategy

__all__ = ["CrabSandboxConfig", "CrabSandboxEnvironment", "CrabSnapshotDetails", "CrabSnapshotStrategy"]

_PROVIDER_NAMES = ("CrabSandboxConfig", "CrabSandboxEnvironment")


def __getattr__(name: str) -> Any:
    if name in _PROVIDER_NAMES:
        from . import provider

        return getattr(provider, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

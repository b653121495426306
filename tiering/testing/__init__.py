"""Test kits shipped with ``tiering`` for plugin authors (they need pytest and pytest-asyncio).

``BackendTests`` is the conformance suite for storage backends: subclass it in your own test
module and implement ``make_backend`` (see :mod:`tiering.testing.backend_tests`).
``PolicyTests`` is the conformance suite for eviction policies: subclass it and override the
``policy_factory`` fixture (see :mod:`tiering.testing.policy_tests`). ``ManagerTests`` is the
conformance suite for scheduler-side managers (the protocol in :mod:`tiering.managers.protocol`):
subclass it and implement ``make_manager`` (see :mod:`tiering.testing.manager_tests`).
``CopyStrategyTests`` is the conformance suite for GPU <-> CPU copy strategies: subclass it and
name the strategy and device (see :mod:`tiering.testing.copy_strategy_tests`).

The suites are imported on first use, so ``import tiering.testing`` works without pytest and
nothing in the library proper pulls pytest in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tiering.testing.backend_tests import BackendTests
    from tiering.testing.copy_strategy_tests import CopyStrategyTests
    from tiering.testing.manager_tests import ManagerTests
    from tiering.testing.policy_tests import PolicyTests

__all__ = ["BackendTests", "CopyStrategyTests", "ManagerTests", "PolicyTests"]

_SUITES = {
    "BackendTests": "tiering.testing.backend_tests",
    "CopyStrategyTests": "tiering.testing.copy_strategy_tests",
    "ManagerTests": "tiering.testing.manager_tests",
    "PolicyTests": "tiering.testing.policy_tests",
}


def __getattr__(name: str) -> object:
    module_name = _SUITES.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in ("pytest", "pytest_asyncio"):
            raise
        raise ImportError(
            f"tiering.testing.{name} needs {exc.name}; install it (pip install pytest "
            "pytest-asyncio) to run the conformance suites"
        ) from exc
    suite: object = getattr(module, name)
    globals()[name] = suite  # later lookups skip __getattr__
    return suite

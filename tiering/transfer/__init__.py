"""GPU <-> CPU block transfers (worker side): the transfer engine and its copy strategies.

* :mod:`tiering.transfer.plan`: transfer jobs (:class:`PoolTransfer`), their validation and
  their copy plans.
* :mod:`tiering.transfer.engine`: :class:`TransferEngine` (``submit_store`` / ``submit_load``
  / ``poll`` / ``wait``) and :class:`TransferHandle`.
* :mod:`tiering.transfer.strategy`: the copy-strategy seam (conformance suite:
  :class:`tiering.testing.copy_strategy_tests.CopyStrategyTests`). The strategies:
  ``triton_copy`` (a page-copy kernel, in ``triton_kernel``), ``batched_memcpy``
  (``cuMemcpyBatchAsync``, through ``cuda_driver``), ``staging`` (gather/scatter through a
  bounded buffer) and ``per_run`` (``memmove`` for CPU caches, ``torch``); ``select`` chooses
  one at run time.
"""

from tiering.transfer.engine import Direction, TransferEngine, TransferHandle
from tiering.transfer.plan import (
    NULL_BLOCK_ID,
    CopyPlan,
    PoolGeometry,
    PoolTransfer,
    TransferPlanner,
    TransferResult,
)
from tiering.transfer.select import (
    COPY_BACKENDS,
    StrategyChoice,
    StrategyOptions,
    machine_choice,
    make_strategy,
)
from tiering.transfer.strategy import STRATEGY_NAMES, CopyBackend, CopyStrategy, StrategyName

__all__ = [
    "COPY_BACKENDS",
    "NULL_BLOCK_ID",
    "STRATEGY_NAMES",
    "CopyBackend",
    "CopyPlan",
    "CopyStrategy",
    "Direction",
    "PoolGeometry",
    "PoolTransfer",
    "StrategyChoice",
    "StrategyName",
    "StrategyOptions",
    "TransferEngine",
    "TransferHandle",
    "TransferPlanner",
    "TransferResult",
    "machine_choice",
    "make_strategy",
]

"""GPU <-> CPU block transfers (worker side): the transfer engine and its copy strategies.

* :mod:`tiering.transfer.plan`: transfer jobs (:class:`PoolTransfer`), their validation and
  their copy plans.
* :mod:`tiering.transfer.engine`: :class:`TransferEngine` (``submit_store`` / ``submit_load``
  / ``poll`` / ``wait``) and :class:`TransferHandle`.
* :mod:`tiering.transfer.strategy`: the copy-strategy seam; the strategies are
  :mod:`~tiering.transfer.triton_copy` (a page-copy kernel), :mod:`~tiering.transfer.
  batched_memcpy` (``cuMemcpyBatchAsync``), :mod:`~tiering.transfer.staging` (gather/scatter
  through a bounded buffer) and :mod:`~tiering.transfer.per_run` (``memmove`` for CPU caches,
  ``torch``); :mod:`~tiering.transfer.select` chooses one.
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

"""tiering's ``vllm.general_plugins`` entry point: registers tiering's names with vLLM's factories.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), once
per process. It registers

- the offloading spec ``TieringSpec`` (:class:`tiering.integrations.vllm.TieringSpec`, the
  drop-in) with vLLM's ``OffloadingSpecFactory``, so that ``"spec_name": "TieringSpec"`` works
  without ``spec_module_path``;
- the secondary-tier type ``tiering``
  (:class:`tiering.integrations.vllm_tiers.TieringSecondaryTier`) with vLLM's
  ``SecondaryTierFactory``, so that ``{"type": "tiering", ...}`` works in ``secondary_tiers``
  of vLLM's own tiering spec.

Registering is lazy on vLLM's side (a module path and a class name): nothing of tiering's is
imported until a spec or a tier is built.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

__all__ = [
    "SPEC_CLASS",
    "SPEC_MODULE",
    "SPEC_NAME",
    "TIER_CLASS",
    "TIER_MODULE",
    "TIER_TYPE",
    "register",
]

logger = logging.getLogger(__name__)

#: The ``type`` of a ``secondary_tiers`` entry that is one of tiering's tiers.
TIER_TYPE = "tiering"
TIER_MODULE = "tiering.integrations.vllm_tiers"
TIER_CLASS = "TieringSecondaryTier"
#: The ``spec_name`` of the drop-in.
SPEC_NAME = "TieringSpec"
SPEC_MODULE = "tiering.integrations.vllm"
SPEC_CLASS = "TieringSpec"


def register() -> None:
    """Register tiering's spec and tier type with vLLM. Idempotent.

    If another package registered the same name first, its registration stays and a warning
    says how to reach tiering's class anyway: a plugin must never stop vLLM from starting for
    engines that do not use it.
    """
    _register_spec()
    _register_tier()


def _register_spec() -> None:
    try:
        OffloadingSpecFactory.register_spec(SPEC_NAME, SPEC_MODULE, SPEC_CLASS)
    except ValueError:
        # Registered already: by an earlier call in this process, or by someone else.
        registered = OffloadingSpecFactory.get_spec_cls({"spec_name": SPEC_NAME})
        if (registered.__module__, registered.__qualname__) != (SPEC_MODULE, SPEC_CLASS):
            logger.warning(
                "vLLM offloading spec %r is already registered to %s.%s; tiering's spec is "
                "reachable with 'spec_module_path': %r",
                SPEC_NAME,
                registered.__module__,
                registered.__qualname__,
                SPEC_MODULE,
            )


def _register_tier() -> None:
    try:
        SecondaryTierFactory.register_tier(TIER_TYPE, TIER_MODULE, TIER_CLASS)
    except ValueError:
        # Registered already: by an earlier call in this process, or by someone else.
        registered = SecondaryTierFactory.get_tier_class({"type": TIER_TYPE})
        if (registered.__module__, registered.__qualname__) != (TIER_MODULE, TIER_CLASS):
            logger.warning(
                "vLLM secondary tier type %r is already registered to %s.%s; tiering's tier "
                "is reachable as {'type': %r, 'module_path': %r}",
                TIER_TYPE,
                registered.__module__,
                registered.__qualname__,
                TIER_CLASS,
                TIER_MODULE,
            )

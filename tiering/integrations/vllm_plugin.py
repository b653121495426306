"""tiering's ``vllm.general_plugins`` entry point: registers tiering's names with vLLM's factories.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), once
per process. It registers the secondary-tier type ``tiering``
(:class:`tiering.integrations.vllm_tiers.TieringSecondaryTier`) with vLLM's
``SecondaryTierFactory``, so that ``{"type": "tiering", ...}`` works in ``secondary_tiers``.
Registering is lazy on vLLM's side (a module path and a class name): nothing of tiering's tier is
imported until a tier is built.
"""

from __future__ import annotations

import logging

from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

__all__ = ["TIER_CLASS", "TIER_MODULE", "TIER_TYPE", "register"]

logger = logging.getLogger(__name__)

#: The ``type`` of a ``secondary_tiers`` entry that is one of tiering's tiers.
TIER_TYPE = "tiering"
TIER_MODULE = "tiering.integrations.vllm_tiers"
TIER_CLASS = "TieringSecondaryTier"


def register() -> None:
    """Register tiering's tier type with vLLM. Idempotent.

    If another package registered the same type name first, its registration stays and a
    warning says how to reach tiering's tier anyway: a plugin must never stop vLLM from starting
    for engines that do not use it.
    """
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

"""Tiers and managers: the offloading protocol engines call, and what answers it.

- :mod:`~tiering.managers.protocol`: the scheduler-side protocol (vLLM's), the ABC every manager
  implements;
- :mod:`~tiering.managers.cpu_manager`: the CPU primary tier (a pool of rows under a policy);
- :mod:`~tiering.managers.secondary_tier` and :mod:`~tiering.managers.shared_tier`: a backend
  behind a policy, with its jobs, deadlines and latencies;
- :mod:`~tiering.managers.tiering_manager`: the primary composed with secondary tiers (its base
  :mod:`~tiering.managers.lifecycle`; its collaborators: ``job_runner``, ``event_log``,
  ``cascade``, ``promotions``, ``shared_checks``, ``tier_lookups``, ``stalls``,
  ``step_results``, ``tiering_stats``);
- :mod:`~tiering.managers.pool`, :mod:`~tiering.managers.io_loop`: the CPU block pool and the
  asyncio loop tier I/O runs on.

Above the policies and backends, below the configuration that builds them.
"""

"""The replay lab: traces, a simulated engine, ``tiering replay`` and the Belady bound.

It sits on top of the core library and the config layer: its modules import them, never the
reverse. ``tiering replay`` (:mod:`tiering.replay.runner`) drives a real
:class:`~tiering.TieringOffloadingManager` with a simulated engine
(:mod:`tiering.replay.sim_engine`) over a trace (:mod:`tiering.replay.traces`) and compares
eviction policies with the offline optimum (:mod:`tiering.replay.belady`).
"""

from tiering.replay.runner import (
    ReplayOptions,
    configure_parser,
    load_trace,
    main,
    policy_study,
    run_replay,
)

__all__ = ["ReplayOptions", "configure_parser", "load_trace", "main", "policy_study", "run_replay"]

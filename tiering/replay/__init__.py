"""The replay lab: traces, a simulated engine, ``tiering replay`` and the Belady bound.

It sits on top of the core library and the config layer: its modules import them, never the
reverse. ``tiering replay`` (:mod:`tiering.replay.runner`) drives a real
:class:`~tiering.TieringOffloadingManager` with a simulated engine
(:mod:`tiering.replay.sim_engine`) over a trace (:mod:`tiering.replay.traces`) and compares
eviction policies with the offline optimum (:mod:`tiering.replay.belady`);
``tiering policy-study`` (:mod:`tiering.replay.study_cli`) does that alone, metadata only, on
Mooncake traces and realistic generated ones (:mod:`tiering.replay.workloads`).
"""

from tiering.replay.runner import (
    ReplayOptions,
    configure_parser,
    load_trace,
    main,
    policy_study,
    run_replay,
)
from tiering.replay.study_cli import configure_parser as configure_study_parser

__all__ = [
    "ReplayOptions",
    "configure_parser",
    "configure_study_parser",
    "load_trace",
    "main",
    "policy_study",
    "run_replay",
]

"""Engine adapters: ``tiering`` wired into serving engines.

Each adapter sits on top of the library and uses only its public API (``tiering``,
``tiering.managers.protocol``, ``tiering.config``); nothing in the core imports an adapter. An
adapter's
engine is an optional dependency: importing ``tiering`` never imports an engine.
"""

"""The topics of :class:`tiering.testing.ManagerTests`, one mixin class per module, composed in
:mod:`tiering.testing.manager_tests`: the base (class attributes, hooks, plumbing and the
``new_manager`` fixture) in :mod:`.base`, then lookups, loads and stores, eviction and events,
requests and stats, misuse, and steps with lower tiers.
"""

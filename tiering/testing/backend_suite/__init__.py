"""The topics of :class:`tiering.testing.BackendTests`, one mixin class per module, composed in
:mod:`tiering.testing.backend_tests`: the base (class attributes, hooks and helpers) in
:mod:`.base`, then lifecycle, round trips, durability (capacity, restart, corruption),
concurrency and cancellation, bad input, and the optional operations with shared stores.
"""

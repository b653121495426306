"""The topics of :class:`tiering.testing.PolicyTests`, one mixin class per module, composed in
:mod:`tiering.testing.policy_tests`: the base (the ``policy_factory`` fixture, the key and state
helpers) in :mod:`.base`, then container behaviour, batch forms, recency (touch and refresh),
pinned and protected keys, removal (all-or-nothing evict, remove, clear), and cost.
"""

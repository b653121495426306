"""A policy whose rule a test switches, for the eviction-rule metrics of the vLLM integrations
(``policy: "switching_policy:SwitchingPolicy"`` in a tier's entry)."""

from __future__ import annotations

from tiering.policies import LRUPolicy


class SwitchingPolicy(LRUPolicy):
    """LRU's victims; reports the rule last set by :meth:`switch_to`, and counts the changes."""

    name = "switching"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._rule = "lru"
        self._switches = 0

    @property
    def rule(self) -> str:
        return self._rule

    @property
    def rules(self) -> tuple[str, ...]:
        return ("lru", "arc")

    @property
    def rule_switches(self) -> int:
        return self._switches

    def switch_to(self, rule: str) -> None:
        if rule != self._rule:
            self._rule = rule
            self._switches += 1

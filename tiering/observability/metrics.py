"""The metrics a manager exposes: their catalogue, and one reading of a manager's counters.

Nothing here runs on the protocol's hot path. The manager and its tiers keep plain integer
counters (``manager.metrics()``, each tier's ``TierMetrics``, each backend's ``BackendStats``)
and each tier's job latencies in fixed memory (:class:`~tiering.managers.latency.LatencyRecord`,
with
exact histogram buckets); :func:`read_samples` and :func:`latency_records` read them when asked
(at a Prometheus scrape, or on an exporter's timer). Reading from another thread is safe: every
value read is one attribute, one ``len()`` or one copy of a list, each atomic under the GIL,
and nothing is written.

Every metric is labelled with ``tier`` (the tier's name; ``primary`` for the CPU tier) and
``medium`` (``CPU``, or the tier's medium). ``docs/metrics.md`` lists them all; a test checks
that it lists exactly :data:`CATALOGUE`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from tiering.managers.latency import LATENCY_BUCKETS_S, LatencyRecord

__all__ = [
    "CATALOGUE",
    "LATENCY_BUCKETS_S",
    "PRIMARY_TIER",
    "MetricSpec",
    "Sample",
    "latency_records",
    "read_samples",
]

#: The ``tier`` label of the CPU primary tier.
PRIMARY_TIER = "primary"
Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric. ``name`` is the exposed name without the ``_total`` a counter gets;
    ``labels`` come after ``tier`` and ``medium``."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


CATALOGUE: tuple[MetricSpec, ...] = (
    # -- usage ---------------------------------------------------------------------------------
    MetricSpec("tiering_capacity_blocks", "gauge", "Blocks the tier can hold."),
    MetricSpec("tiering_used_blocks", "gauge", "Blocks the tier holds now."),
    MetricSpec(
        "tiering_effective_capacity_blocks",
        "gauge",
        "Blocks the tier may hold now: its capacity, less when a disk guard (min_free_bytes) "
        "shrinks it (secondary tiers).",
    ),
    MetricSpec("tiering_block_bytes", "gauge", "Bytes of one block (one CPU pool row)."),
    MetricSpec("tiering_inflight_jobs", "gauge", "Promotion and store jobs in flight."),
    MetricSpec(
        "tiering_stalled",
        "gauge",
        "1 while the tier is stalled (a job ran past io_timeout_s and its I/O has not "
        "returned), else 0.",
    ),
    # -- lookups -------------------------------------------------------------------------------
    MetricSpec(
        "tiering_lookups",
        "counter",
        "Keys looked up in the primary tier, by any lookup call (primary only).",
    ),
    MetricSpec(
        "tiering_lookup_hits",
        "counter",
        "Keys a lookup found ready in the tier (a secondary tier: absent from the primary).",
    ),
    MetricSpec(
        "tiering_lookup_misses",
        "counter",
        "Keys a lookup did not find in the primary tier (primary only; the secondary tiers "
        "are asked next).",
    ),
    # -- data moved ----------------------------------------------------------------------------
    MetricSpec("tiering_store_jobs", "counter", "Store (write) jobs started to the tier."),
    MetricSpec("tiering_stored_blocks", "counter", "Blocks written to the tier and published."),
    MetricSpec(
        "tiering_loaded_blocks",
        "counter",
        "Blocks the engine loaded from the primary tier (prepare_load; primary only).",
    ),
    MetricSpec("tiering_promotions", "counter", "Promotion jobs (tier to primary) started."),
    MetricSpec("tiering_promoted_blocks", "counter", "Blocks promoted from the tier."),
    MetricSpec(
        "tiering_promotions_without_space",
        "counter",
        "Promotions that found no free primary slot (primary only).",
    ),
    MetricSpec("tiering_written_bytes", "counter", "Payload bytes written to the tier."),
    MetricSpec("tiering_read_bytes", "counter", "Payload bytes read from the tier."),
    # -- pressure and failures -----------------------------------------------------------------
    MetricSpec("tiering_evicted_blocks", "counter", "Blocks evicted from the tier."),
    MetricSpec(
        "tiering_shed_stores",
        "counter",
        "Blocks not written to the tier: too many jobs in flight or no room to evict.",
    ),
    MetricSpec(
        "tiering_stores_not_admitted",
        "counter",
        "Blocks not written to the tier: its admission gate had not seen them looked up "
        "admission_min_count times recently.",
    ),
    MetricSpec(
        "tiering_full_retries", "counter", "Writes retried after the backend reported full."
    ),
    MetricSpec(
        "tiering_stores_below_threshold",
        "counter",
        "Blocks offered to the primary tier and not stored: offered fewer than "
        "store_threshold times (primary only).",
    ),
    MetricSpec(
        "tiering_failures",
        "counter",
        "Blocks whose store or promotion failed, by kind (store, promotion).",
        ("kind",),
    ),
    MetricSpec(
        "tiering_corrupt_blocks",
        "counter",
        "Blocks that failed verification on read (never served; part of promotion failures).",
    ),
    MetricSpec(
        "tiering_timed_out_jobs",
        "counter",
        "Jobs that ran past the tier's io_timeout_s (failed; their blocks are misses).",
    ),
    MetricSpec(
        "tiering_quarantined_keys",
        "counter",
        "Keys quarantined after a failed read (treated as absent for a while).",
    ),
    # -- eviction ------------------------------------------------------------------------------
    MetricSpec(
        "tiering_eviction_rule",
        "gauge",
        "1 for the victim rule the tier's eviction policy follows now, 0 for the others it may "
        "follow (hybrid: hybrid, lru or arc, chosen by its shadow caches; another policy: its "
        "name).",
        ("rule",),
    ),
    MetricSpec(
        "tiering_eviction_rule_switches",
        "counter",
        "Times the tier's eviction policy changed the rule it follows (hybrid; 0 for a "
        "policy of one rule).",
    ),
    # -- the callers' hints (the primary's policy) ------------------------------------------------
    MetricSpec(
        "tiering_hinted_requests",
        "counter",
        "Requests told with a continuation hint, continues true or false (primary only).",
    ),
    MetricSpec(
        "tiering_hints_followed",
        "counter",
        "Hinted requests whose hint the primary's eviction policy followed (primary only; "
        "chain, while hints of that value tell continued requests apart; none from a policy "
        "that does not follow hints).",
    ),
    # -- a shared tier (no index: it asks the store) ---------------------------------------------
    MetricSpec(
        "tiering_existence_checks",
        "counter",
        "Existence checks a shared tier sent (one per request and step with unknown keys).",
    ),
    MetricSpec(
        "tiering_checked_keys",
        "counter",
        "Keys a shared tier's existence checks answered, by result (present, absent, unknown: "
        "the store node failed).",
        ("result",),
    ),
    MetricSpec(
        "tiering_cached_misses",
        "counter",
        "Lookups a shared tier answered absent from its cache (or quarantine), not asking.",
    ),
    MetricSpec(
        "tiering_skipped_writes",
        "counter",
        "Blocks a shared tier did not write because the store held them, by how it knew "
        "(cached: not sent; present: sent, the store kept its own).",
        ("reason",),
    ),
    # -- the backend ---------------------------------------------------------------------------
    MetricSpec(
        "tiering_backend_operations",
        "counter",
        "Blocks the backend was asked to put, get or delete, by op.",
        ("op",),
    ),
    MetricSpec(
        "tiering_backend_results",
        "counter",
        "Outcomes of the backend's block reads and writes, by result "
        "(hit, miss, corrupt, read_failure, put_failure).",
        ("result",),
    ),
    # -- latency -------------------------------------------------------------------------------
    MetricSpec(
        "tiering_job_latency_seconds",
        "histogram",
        "Latency of one tier job (one batch of blocks), by op (load, store).",
        ("op",),
    ),
)

_SPECS = {spec.name: spec for spec in CATALOGUE}


@dataclass(frozen=True)
class Sample:
    """One value of a counter or gauge: ``labels`` are ``(tier, medium, *spec.labels)``."""

    name: str
    labels: tuple[str, ...]
    value: float


class _TierLike(Protocol):
    name: str
    medium: str
    metrics: Any
    backend: Any
    inflight_jobs: int
    is_open: bool

    @property
    def capacity_blocks(self) -> int: ...

    def __len__(self) -> int: ...


class ManagerLike(Protocol):
    """What is read: a :class:`~tiering.TieringOffloadingManager`'s public attributes."""

    row_bytes: int
    primary: Any

    @property
    def tiers(self) -> list[Any]: ...

    def metrics(self) -> dict[str, Any]: ...


def read_samples(manager: ManagerLike) -> Iterator[Sample]:
    """The counters and gauges of ``manager`` and its tiers, now."""
    counters = manager.metrics()
    primary = counters["primary"]
    labels = (PRIMARY_TIER, str(manager.primary.medium))
    row_bytes = manager.row_bytes
    yield Sample("tiering_capacity_blocks", labels, manager.primary.num_blocks)
    yield Sample("tiering_used_blocks", labels, primary["blocks"])
    yield Sample("tiering_block_bytes", labels, row_bytes)
    yield Sample("tiering_promotions_without_space", labels, primary["promotions_without_space"])
    for name, key in (
        ("tiering_lookups", "lookups"),
        ("tiering_lookup_hits", "lookup_hits"),
        ("tiering_lookup_misses", "lookup_misses"),
        ("tiering_stored_blocks", "stored_blocks"),
        ("tiering_loaded_blocks", "loaded_blocks"),
        ("tiering_evicted_blocks", "evicted_blocks"),
        ("tiering_stores_below_threshold", "stores_skipped"),
        ("tiering_hinted_requests", "hinted_requests"),
    ):
        yield Sample(name, labels, primary[key])
    if "hints_followed" in primary:  # a policy that follows hints
        yield Sample("tiering_hints_followed", labels, primary["hints_followed"])
    # Each block the engine stores or loads is one pool row, copied whole.
    yield Sample("tiering_written_bytes", labels, primary["stored_blocks"] * row_bytes)
    yield Sample("tiering_read_bytes", labels, primary["loaded_blocks"] * row_bytes)
    yield Sample("tiering_failures", (*labels, "store"), primary["failed_stores"])
    yield from _rule_samples(labels, primary)
    for tier in manager.tiers:
        yield from _tier_samples(tier, counters[tier.name], manager.row_bytes)


def _tier_samples(tier: _TierLike, counters: dict[str, Any], row_bytes: int) -> Iterator[Sample]:
    labels = (tier.name, tier.medium)
    yield Sample("tiering_capacity_blocks", labels, counters["capacity_blocks"])
    yield Sample("tiering_used_blocks", labels, counters["blocks"])
    yield Sample("tiering_effective_capacity_blocks", labels, counters["effective_capacity_blocks"])
    yield Sample("tiering_block_bytes", labels, row_bytes)
    yield Sample("tiering_inflight_jobs", labels, counters["inflight_jobs"])
    yield Sample("tiering_stalled", labels, 1 if counters["stalled"] else 0)
    for name, key in (
        ("tiering_lookup_hits", "lookup_hits"),
        ("tiering_store_jobs", "store_jobs"),
        ("tiering_stored_blocks", "stored_blocks"),
        ("tiering_promotions", "promotions"),
        ("tiering_promoted_blocks", "promoted_blocks"),
        ("tiering_written_bytes", "bytes_written"),
        ("tiering_read_bytes", "bytes_read"),
        ("tiering_evicted_blocks", "evictions"),
        ("tiering_shed_stores", "stores_shed"),
        ("tiering_stores_not_admitted", "stores_not_admitted"),
        ("tiering_full_retries", "full_retries"),
        ("tiering_corrupt_blocks", "corrupt_blocks"),
        ("tiering_quarantined_keys", "quarantined"),
        ("tiering_timed_out_jobs", "timed_out_jobs"),
    ):
        yield Sample(name, labels, counters[key])
    yield Sample("tiering_failures", (*labels, "store"), counters["store_failures"])
    yield Sample("tiering_failures", (*labels, "promotion"), counters["promotion_failures"])
    if "existence_checks" in counters:  # a shared tier
        yield Sample("tiering_existence_checks", labels, counters["existence_checks"])
        for result, key in (
            ("present", "check_hits"),
            ("absent", "check_absent"),
            ("unknown", "check_unknown"),
        ):
            yield Sample("tiering_checked_keys", (*labels, result), counters[key])
        yield Sample("tiering_cached_misses", labels, counters["cached_misses"])
        yield Sample("tiering_skipped_writes", (*labels, "cached"),
                     counters["writes_skipped_cached"])  # fmt: skip
        yield Sample("tiering_skipped_writes", (*labels, "present"),
                     counters["put_skipped_present"])  # fmt: skip
    yield from _rule_samples(labels, counters)
    backend = counters["backend"]
    for op, key in (("put", "puts"), ("get", "gets"), ("delete", "deletes")):
        yield Sample("tiering_backend_operations", (*labels, op), backend[key])
    for result, key in (
        ("hit", "hits"),
        ("miss", "misses"),
        ("corrupt", "corrupt"),
        ("read_failure", "read_failures"),
        ("put_failure", "put_failures"),
    ):
        yield Sample("tiering_backend_results", (*labels, result), backend[key])


def _rule_samples(labels: tuple[str, str], counters: dict[str, Any]) -> Iterator[Sample]:
    # A tier that is not open has no policy, and no rule to report.
    if "eviction_rule" not in counters:
        return
    followed = counters["eviction_rule"]
    for rule in counters["eviction_rules"]:
        yield Sample("tiering_eviction_rule", (*labels, rule), 1 if rule == followed else 0)
    yield Sample("tiering_eviction_rule_switches", labels, counters["eviction_rule_switches"])


def latency_records(manager: ManagerLike) -> Iterator[tuple[tuple[str, str, str], LatencyRecord]]:
    """``((tier, medium, op), record)`` of every secondary tier's job latencies, op ``load`` or
    ``store``; each record's counts are cumulative since the tier was built."""
    for tier in manager.tiers:
        yield (tier.name, tier.medium, "load"), tier.metrics.load_latency_s
        yield (tier.name, tier.medium, "store"), tier.metrics.store_latency_s


def spec(name: str) -> MetricSpec:
    return _SPECS[name]

"""The metadata-only what-if: eviction policies and Belady's bound on a trace, per CPU size.

No data moves: each policy is driven the way the manager drives it, request by request, over
the requests' block keys in prefix order:

1. every key of the request is looked up: a held key is a *block hit*; the leading run of
   held keys is the request's *prefix hit* (what an engine can skip: a block is useless after
   the first missing one);
2. ``touch(keys)`` (the manager's touch on a load: ``keys[0]`` ends most recent; absent keys
   are ignored);
3. the missing keys are stored: ``note_misses(missing)`` (a policy that adapts on misses,
   as ``arc_vllm`` does, learns of them before the eviction, as from the manager),
   ``evict(shortfall, protected=set(keys))`` (unprotected if that fails), then
   ``insert_new(missing)`` in prefix order. A request with more missing keys than the tier
   holds stores them in chunks of the capacity, as demand paging would.

Belady's MIN runs on the same requests, each looked up whole before its misses are stored
(:func:`tiering.replay.belady.belady_request_hits`): it bounds every policy's block hits here
(not their prefix hits), whatever the capacity.

Each policy's row also says which victim rules it followed (``rule_shares``: the share of the
requests that stored misses under each :attr:`~tiering.policies.base.EvictionPolicy.rule`,
and ``rule_switches``): ``hybrid``'s duel, made visible; a policy of one rule has one share.

Secondary tiers. With a config, each secondary tier is modelled with its own policy, capacity
(its byte budget over the study's block bytes) and write policy: a CPU miss is looked up in
the tiers in order (a hit there is served, *promoted*, and not written again); a block no tier
served is written to each ``write_through`` tier that does not hold it, to each
``write_through_selective`` tier once it was looked up ``selective_min_lookups`` times, and to
each ``write_back`` tier when the CPU evicts it; a request's writes to a tier are one store, as
the tier's index reserves one (``note_misses``, ``evict``, ``insert_new``). Admission: a
selective tier's ``selective_min_lookups`` is its gate, and ``admission_min_count`` adds a
count-min sketch (:mod:`tiering.policies.admission`, sized as the running tier sizes it) to a
tier, recording each key looked up in it; the study reports the bytes written per served
block with the gates and without them (every gated tier written through).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from tiering.errors import InvalidArgumentError, TieringError
from tiering.policies import get_policy_class
from tiering.policies.admission import FrequencyGate, default_width
from tiering.policies.base import EvictionPolicy, tell_request
from tiering.replay.belady import RequestMIN
from tiering.replay.block_trace import BlockRequest, PrefixTrie
from tiering.replay.forked_map import map_forked
from tiering.replay.progress import ProgressBar

__all__ = [
    "StudyTrace",
    "TierModel",
    "gap_closed",
    "ids_per_block",
    "policy_study",
    "prefix_hits",
    "run_study",
    "simulate_cpu",
    "study_trace_from_blocks",
]


@dataclass(frozen=True)
class StudyTrace:
    """Per request, its block keys in prefix order and its prompt tokens; tokens per block;
    per request the client's hint, where any request has one (else ``None``)."""

    key_lists: list[list[bytes]]
    input_tokens: list[int]
    block_tokens: int
    hints: list[bool | None] | None = None

    @property
    def unique_blocks(self) -> int:
        return len({k for keys in self.key_lists for k in keys})

    @property
    def block_accesses(self) -> int:
        return sum(map(len, self.key_lists))


def ids_per_block(study_block_tokens: int | None, block_tokens: int) -> int:
    """How many of a trace's ids of ``block_tokens`` make one study block of
    ``study_block_tokens`` (``None``: one). Raises :class:`TieringError` naming both numbers
    and a valid size if it is not a positive multiple."""
    if study_block_tokens is None:
        return 1
    if study_block_tokens <= 0 or study_block_tokens % block_tokens:
        raise TieringError(
            f"--study-block-tokens {study_block_tokens} is not a multiple of the trace's "
            f"{block_tokens} tokens per id: use a multiple of {block_tokens} (e.g. "
            f"{block_tokens * max(1, -(-study_block_tokens // block_tokens))})"
        )
    return study_block_tokens // block_tokens


def study_trace_from_blocks(
    requests: Iterable[BlockRequest],
    block_tokens: int,
    ids_per_block: int = 1,
    *,
    max_requests: int | None = None,
) -> StudyTrace:
    """Keys of a block trace: ids chained along each prompt (:class:`PrefixTrie`). A prompt's
    partial last block is dropped: an engine hashes, stores and reuses full blocks only.

    ``requests`` may come in any order and be read as they come (as
    :func:`~tiering.replay.block_trace.open_block_trace` reads a file): only their keys are
    kept, and the study's order is by arrival (stable), of which the first ``max_requests``.

    With ``ids_per_block`` > 1, that many consecutive ids of ``block_tokens`` make one study
    block (an engine that offloads larger blocks than the trace's ids: a 16-token trace
    studied in 256-token blocks has a sixteenth of the references); its key names the prefix
    ending at its last id, and a group the prompt does not fill is dropped."""
    trie = PrefixTrie()
    study_tokens = block_tokens * ids_per_block
    groups: dict[tuple[int, ...], int] = {}  # a group of ids as one id: k times fewer nodes
    node_lists: list[list[int]] = []
    arrivals: list[float] = []
    input_tokens: list[int] = []
    hints: list[bool | None] = []
    for r in requests:
        ids = r.block_ids[: r.input_tokens // study_tokens * ids_per_block]
        if ids_per_block > 1:
            k = ids_per_block
            ids = tuple(
                groups.setdefault(ids[i : i + k], len(groups))
                for i in range(0, len(ids) - k + 1, k)
            )
        node_lists.append(trie.keys(ids))
        arrivals.append(r.arrival_s)
        input_tokens.append(r.input_tokens)
        hints.append(r.continues)
    node_count = len(trie)
    del trie, groups  # the largest structures here: gone before the names are made
    order: Sequence[int] = range(len(node_lists))
    if any(later < earlier for earlier, later in itertools.pairwise(arrivals)):
        order = sorted(order, key=arrivals.__getitem__)
    order = order[:max_requests]
    names = [i.to_bytes(8, "little") for i in range(node_count)]
    return StudyTrace(
        [[names[n] for n in node_lists[i]] for i in order],
        [input_tokens[i] for i in order],
        study_tokens,
        [hints[i] for i in order] if any(hint is not None for hint in hints) else None,
    )


@dataclass(frozen=True)
class TierModel:
    """A secondary tier as the study models it."""

    name: str
    capacity_blocks: int
    policy: str = "lru"
    write_policy: str = "write_through"
    selective_min_lookups: int = 2
    admission_min_count: int = 0  # 0: no admission gate
    admission_width: int = 0  # the gate's counters per row; 0: default_width(capacity_blocks)
    block_bytes: int = 0


@dataclass
class _CpuRun:
    flags: bytearray
    victims: list[list[bytes]] = field(default_factory=list)  # per request, the CPU evicted
    requests_by_rule: dict[str, int] = field(default_factory=dict)  # the rule each stored by
    rule_switches: int = 0


def simulate_cpu(
    policy: EvictionPolicy,
    key_lists: Sequence[Sequence[bytes]],
    *,
    record_victims: bool = False,
    hints: Sequence[bool | None] | None = None,
) -> _CpuRun:
    """Drive ``policy`` (empty, its capacity the tier's) as the manager does; one hit flag
    per access, per request the keys evicted (``record_victims``), and how many requests
    stored their misses under each of the policy's rules (:attr:`EvictionPolicy.rule`).
    ``hints``: per request, the caller's hint (:meth:`EvictionPolicy.note_request`'s
    ``continues``), given with the request as a manager gives it."""
    if hints is not None and len(hints) != len(key_lists):
        raise InvalidArgumentError(
            f"hints must have one entry per request ({len(key_lists)}), got {len(hints)}"
        )
    capacity = policy.capacity
    flags = bytearray(sum(map(len, key_lists)))
    run = _CpuRun(flags)
    if capacity == 0:
        run.victims = [[] for _ in key_lists] if record_victims else []
        return run
    contains, touch = policy.__contains__, policy.touch
    evict, insert_new, note_misses = policy.evict, policy.insert_new, policy.note_misses
    note_request = policy.note_request
    by_rule = run.requests_by_rule
    position = 0
    for index, keys in enumerate(key_lists):
        if hints is None:
            note_request(keys)  # as the managers do at a request's start
        else:
            tell_request(policy, keys, continues=hints[index])
        missing: list[bytes] = []
        for i, key in enumerate(keys):
            if contains(key):
                flags[position + i] = 1
            else:
                missing.append(key)
        position += len(keys)
        if len(missing) < len(keys):
            touch(keys)
        if missing:
            rule = policy.rule
            by_rule[rule] = by_rule.get(rule, 0) + 1
        victims: list[bytes] = []
        protected = set(keys)
        for start in range(0, len(missing), capacity):
            chunk = missing[start : start + capacity]
            note_misses(chunk)  # before the eviction, as the manager calls it
            shortfall = len(policy) + len(chunk) - capacity
            if shortfall > 0:
                taken = evict(shortfall, protected)
                if taken is None:
                    taken = evict(shortfall)
                if taken is None:
                    raise TieringError(
                        f"policy {type(policy).__name__} refused to evict {shortfall} of "
                        f"{len(policy)} unpinned keys"
                    )
                victims += taken
            insert_new(chunk)
        if record_victims:
            run.victims.append(victims)
    run.rule_switches = policy.rule_switches
    return run


def prefix_hits(flags: bytearray, key_lists: Sequence[Sequence[bytes]]) -> list[int]:
    """Per request, how many of its blocks from the first on were held (``flags``: one per
    access, the requests' accesses in order)."""
    out = []
    start = 0
    for keys in key_lists:
        end = start + len(keys)
        try:
            out.append(flags.index(0, start, end) - start)
        except ValueError:
            out.append(end - start)
        start = end
    return out


def _tokens_saved(prefix: Sequence[int], trace: StudyTrace) -> int:
    block = trace.block_tokens
    return sum(
        min(hits * block, tokens) for hits, tokens in zip(prefix, trace.input_tokens, strict=True)
    )


def _simulate_tiers(
    trace: StudyTrace, cpu: _CpuRun, tiers: Sequence[TierModel], gated: bool
) -> tuple[bytearray, list[dict[str, int]]]:
    """Served flags (CPU or a tier) per access and per tier: blocks served, blocks written."""
    served = bytearray(cpu.flags)
    policies = [get_policy_class(t.policy)(t.capacity_blocks) for t in tiers]
    gates = [
        FrequencyGate(t.admission_width or default_width(t.capacity_blocks), t.admission_min_count)
        if gated and t.admission_min_count > 0
        else None
        for t in tiers
    ]
    counts = [{"served_blocks": 0, "written_blocks": 0} for _ in tiers]
    # Each tier's held keys, kept from what its policy inserts and evicts (a touch moves
    # none): a set probe costs a tenth of a policy's ``__contains__``, on every CPU miss.
    helds: list[set[bytes]] = [set() for _ in tiers]
    count_lookups = gated and any(t.write_policy == "write_through_selective" for t in tiers)
    lookups: dict[bytes, int] = {}
    flags = cpu.flags
    position = 0

    def write(i: int, keys: list[bytes]) -> None:
        # A request's keys as one store, as the tier's index reserves one: the absent keys
        # noted as misses, room evicted, then inserted; in chunks of the capacity, a later
        # chunk free to evict an earlier one, as an engine's later steps' stores are.
        policy, held = policies[i], helds[i]
        capacity = policy.capacity
        to_write = [key for key in keys if key not in held]
        if not to_write or capacity == 0:
            return
        for start in range(0, len(to_write), capacity):
            chunk = to_write[start : start + capacity]
            policy.note_misses(chunk)
            shortfall = len(policy) + len(chunk) - capacity
            if shortfall > 0:
                victims = policy.evict(shortfall)
                if victims is None:
                    continue
                held.difference_update(victims)
            policy.insert_new(chunk)
            held.update(chunk)
            counts[i]["written_blocks"] += len(chunk)

    tier_range = range(len(tiers))
    for r, keys in enumerate(trace.key_lists):
        computed: list[bytes] = []
        for i, key in enumerate(keys):
            if flags[position + i]:
                continue
            if count_lookups:
                lookups[key] = lookups.get(key, 0) + 1
            for t in tier_range:
                gate = gates[t]
                if gate is not None:
                    gate.record(key)
                if key in helds[t]:
                    policies[t].touch([key])
                    counts[t]["served_blocks"] += 1
                    served[position + i] = 1
                    break
            else:
                computed.append(key)
        position += len(keys)
        for t, tier in enumerate(tiers):
            gate = gates[t]
            if tier.write_policy == "write_back":
                offered = cpu.victims[r] if cpu.victims else []
            elif tier.write_policy == "write_through_selective" and gated:
                offered = [k for k in computed if lookups[k] >= tier.selective_min_lookups]
            else:
                offered = computed
            if gate is not None:
                offered = [key for key in offered if gate.admits(key)]
            if offered:
                write(t, offered)
    return served, counts


def run_study(
    trace: StudyTrace,
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    tiers: Sequence[TierModel] = (),
    block_bytes: int = 0,
    belady: bool = True,
    progress: bool = False,
    jobs: int = 1,
) -> list[dict[str, Any]]:
    """One row per (capacity, policy), Belady last per capacity (see the module docstring).

    ``jobs > 1`` studies that many (capacity, policy) pairs at once in forked processes
    (:mod:`tiering.replay.forked_map`: the same rows, in the same order; memory grows with
    ``jobs``)."""
    names = [*policies, *(["belady"] if belady else [])]
    pairs = [(capacity, name) for capacity in capacities for name in names]
    request_min = RequestMIN(trace.key_lists) if "belady" in names else None
    study = _Study(trace, tiers, block_bytes, request_min)
    rows: list[dict[str, Any]] = [{} for _ in pairs]
    try:
        with map_forked(lambda i: study.row(*pairs[i]), len(pairs), jobs) as results:
            with ProgressBar(len(pairs), "policy study", enabled=progress) as bar:
                for i, row in results:
                    rows[i] = row
                    bar.update()
    except BrokenProcessPool as exc:  # a worker killed (by the kernel for memory, most often)
        raise TieringError(
            f"a study process of {jobs} jobs ended abruptly (killed, out of memory?): each "
            "job may hold a copy of the trace's keys; rerun with fewer jobs"
        ) from exc
    _add_gap_closed(rows)
    return rows


class _Study:
    """What every row of one study reads: the trace, the tiers, Belady's next uses."""

    def __init__(
        self,
        trace: StudyTrace,
        tiers: Sequence[TierModel],
        block_bytes: int,
        request_min: RequestMIN | None,
    ) -> None:
        self.trace = trace
        self.tiers = tiers
        self.block_bytes = block_bytes
        self.request_min = request_min
        self.record_victims = any(t.write_policy == "write_back" for t in tiers)
        self.prompt_tokens = sum(trace.input_tokens)

    def row(self, capacity: int, name: str) -> dict[str, Any]:
        trace, block_bytes = self.trace, self.block_bytes
        key_lists, accesses = trace.key_lists, trace.block_accesses
        if name == "belady" and self.request_min is not None:
            cpu = _CpuRun(self.request_min.hit_flags(capacity))
        else:
            policy = get_policy_class(name)(capacity)
            cpu = simulate_cpu(
                policy, key_lists, record_victims=self.record_victims, hints=trace.hints
            )
        prefix = prefix_hits(cpu.flags, key_lists)
        saved = _tokens_saved(prefix, trace)
        prompt_tokens = self.prompt_tokens
        row: dict[str, Any] = {
            "policy": name,
            "capacity_blocks": capacity,
            "block_hit_ratio": round(sum(cpu.flags) / accesses, 4) if accesses else 0.0,
            "prefix_hit_ratio": round(sum(prefix) / accesses, 4) if accesses else 0.0,
            "prefill_tokens_saved": saved,
            "prefill_saved_ratio": round(saved / prompt_tokens, 4) if prompt_tokens else 0,
            "bytes_stored_cpu": (accesses - sum(cpu.flags)) * block_bytes,
        }
        if name != "belady":
            row.update(_rule_columns(cpu))
        if self.tiers and (name != "belady" or not self.record_victims):
            row.update(_tier_columns(trace, cpu, self.tiers, block_bytes))
        return row


def _rule_columns(cpu: _CpuRun) -> dict[str, Any]:
    # Which victim rules an adaptive policy (hybrid) followed: shares of the requests that
    # stored misses, and the switches; a policy of one rule shows that rule at 1.0.
    stored = sum(cpu.requests_by_rule.values())
    shares = {rule: round(n / stored, 4) for rule, n in sorted(cpu.requests_by_rule.items())}
    return {"rule_shares": shares, "rule_switches": cpu.rule_switches}


def gap_closed(ratio: float, lru: float, belady: float) -> float | None:
    """The share of the distance from LRU's prefix hit ratio to Belady's that ``ratio`` covers
    (0: LRU's, 1: Belady's, negative: under LRU); ``None`` where there is no distance."""
    if belady - lru < 1e-9:
        return None
    return (ratio - lru) / (belady - lru)


def _add_gap_closed(rows: list[dict[str, Any]]) -> None:
    # Per capacity, with LRU and Belady both studied: how an operator reads a policy's gain.
    by_capacity: dict[int, dict[str, float]] = {}
    for row in rows:
        by_capacity.setdefault(row["capacity_blocks"], {})[row["policy"]] = row["prefix_hit_ratio"]
    for row in rows:
        ratios = by_capacity[row["capacity_blocks"]]
        share = None
        if "lru" in ratios and "belady" in ratios:
            share = gap_closed(row["prefix_hit_ratio"], ratios["lru"], ratios["belady"])
        row["lru_belady_gap_closed"] = None if share is None else round(share, 4)


def _tier_columns(
    trace: StudyTrace, cpu: _CpuRun, tiers: Sequence[TierModel], block_bytes: int
) -> dict[str, Any]:
    served, counts = _simulate_tiers(trace, cpu, tiers, gated=True)
    gated = any(
        t.admission_min_count > 0 or t.write_policy == "write_through_selective" for t in tiers
    )
    ungated = _simulate_tiers(trace, cpu, tiers, gated=False)[1] if gated else counts
    prefix = prefix_hits(served, trace.key_lists)
    accesses = trace.block_accesses
    columns: dict[str, Any] = {
        "prefix_hit_ratio_with_tiers": round(sum(prefix) / accesses, 4) if accesses else 0.0,
        "prefill_tokens_saved_with_tiers": _tokens_saved(prefix, trace),
    }
    tier_rows = {}
    for tier, with_gate, without in zip(tiers, counts, ungated, strict=True):

        def per_hit(c: dict[str, int]) -> float | None:
            if not c["served_blocks"]:
                return None
            return round(c["written_blocks"] * block_bytes / c["served_blocks"])

        tier_rows[tier.name] = {
            "capacity_blocks": tier.capacity_blocks,
            "served_blocks": with_gate["served_blocks"],
            "bytes_written": with_gate["written_blocks"] * block_bytes,
            "bytes_written_per_hit": per_hit(with_gate),
            "bytes_written_without_admission": without["written_blocks"] * block_bytes,
            "bytes_written_per_hit_without_admission": per_hit(without),
            "served_blocks_without_admission": without["served_blocks"],
        }
    columns["tiers"] = tier_rows
    return columns


def capacities_for(unique_blocks: int, fractions: Sequence[float]) -> list[int]:
    """CPU sizes in blocks for ``fractions`` of the trace's unique blocks (at least 1 each)."""
    return sorted({max(1, math.ceil(unique_blocks * f)) for f in fractions})


def policy_study(
    key_lists: Sequence[Sequence[bytes]],
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    progress: bool = False,
    hints: Sequence[bool | None] | None = None,
) -> list[dict[str, Any]]:
    """Block and usable-prefix hit ratios of each policy and of Belady's bound, per capacity
    (``replay --policy-study``: one tier, no bytes); ``hints``: per request, the client's."""
    given = list(hints) if hints is not None and any(h is not None for h in hints) else None
    trace = StudyTrace([list(k) for k in key_lists], [0] * len(key_lists), 0, given)
    rows = run_study(trace, capacities, policies, progress=progress)
    keep = (
        "policy",
        "capacity_blocks",
        "block_hit_ratio",
        "prefix_hit_ratio",
        "lru_belady_gap_closed",
    )
    return [{k: row[k] for k in keep} for row in rows]

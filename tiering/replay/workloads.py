"""Realistic generated traces: the shape of production LLM traffic, at the block level.

The built-in traces of :mod:`tiering.replay.traces` (``chat``, ``rag``, ``agent``, ``mixed``)
exercise the data path; the ones here reproduce what decides a KV cache's hit ratio in
production, following the published Mooncake traces (FAST'25) and their analyses:

- **Multi-turn conversations**: the next turn's prompt is the whole previous conversation
  (prompt and answer) plus a new user message, arriving after a think time (log-normal,
  median 60 s, tail to half an hour): a conversation's blocks are reused after minutes, long
  after an LRU of modest size has lost them. Conversations differ in how long they go on:
  each continues after every turn with its own probability, drawn from Beta(0.6, 1.6)
  (1.9 turns on average, 2.0 before; 73 % single-turn; 2 % of 10 turns or more), so one that
  has gone on is likelier to go on again. A single probability for all (geometric turns)
  makes the age of a block the only thing an online policy can know of its future, and LRU
  close to the online optimum; it also put ARC under LRU at every size, where on the public
  Mooncake conversation trace ARC is above LRU (12 % of the LRU -> Belady gap at 4.5 % of the
  unique blocks). The Beta's first parameter is set to reproduce that share (11.6 % over seeds 0 and
  1); docs/workloads.md has the figures before and after.
- **Shared system prompts per tenant** (Zipf popularity over tenants): the roots every
  request of a tenant shares.
- **Tool/agent loops**: a long tool prompt per tenant, then steps seconds apart, each adding
  an action and a tool observation to the context.
- **Long one-off documents**: 8k-64k-token documents asked about once (sometimes a follow-up):
  blocks that flood a cache and never return.
- **Arrivals**: sessions start as a Poisson process, or bursty (a Markov-modulated Poisson
  process alternating 3x-rate bursts of ~2 minutes with calm periods); each session's later
  requests follow its own think times.

Every request is a :class:`~tiering.replay.block_trace.BlockRequest` of 512-token blocks, the
Mooncake format, or of ``block_tokens`` (16 as the Qwen-Bailian traces and vLLM's GPU blocks:
the same prompts, for a seed): the study reads it directly, a replay expands it to tokens
(:func:`~tiering.replay.block_trace.to_requests`). A prompt's partial last block gets an id of
its own (its tokens differ from any longer prompt's), as in the Mooncake traces.

Built-in names (``--trace``): ``conversation``, ``toolagent``, ``documents`` (each alone,
Poisson arrivals) and ``production`` (the three mixed, bursty arrivals). Scale ``demo`` is one
hour at 12,000 requests per hour (the Mooncake conversation trace's rate); ``tiny`` a tenth,
``large`` five times. Deterministic for a seed. Their statistics, next to the published ones,
are in docs/workloads.md ("Realistic generated traces").
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from tiering.config import WORKLOAD_TRACES
from tiering.config.workload_shape import WorkloadShape, parse_shape
from tiering.errors import ConfigurationError
from tiering.replay.block_trace import DEFAULT_BLOCK_TOKENS, BlockRequest

__all__ = [
    "WORKLOAD_TRACES",
    "WorkloadMix",
    "SHAPE_HELP",
    "WorkloadShape",
    "check_shape_applies",
    "generate",
    "parse_shape",
    "resolve_shape",
    "workload_trace",
]


_SCALE_HOURS = {"tiny": 0.1, "demo": 1.0, "large": 5.0}
_CALIBRATED = WorkloadShape()
_REQUESTS_PER_HOUR = 12_000


def check_shape_applies(trace: str) -> None:
    """A shape is for a generated trace: :class:`~tiering.errors.ConfigurationError` unless
    ``trace`` names one."""
    if trace not in _MIXES:
        raise ConfigurationError(
            f"--shape applies to the generated traces ({', '.join(WORKLOAD_TRACES)}); "
            f"{trace!r} is not one"
        )


def resolve_shape(option: str | None, configured: str | None, trace: str) -> WorkloadShape | None:
    """The shape a command generates ``trace`` in: its ``--shape`` (``option``; an error unless
    ``trace`` is a generated trace), else the config's ``replay.shape`` (``configured``) where
    ``trace`` is generated, else ``None`` (the calibrated shape)."""
    if option is not None:
        check_shape_applies(trace)
        try:
            return parse_shape(option)
        except ConfigurationError as exc:
            raise ConfigurationError(f"--shape: {exc}") from None
    if configured is not None and trace in _MIXES:
        return parse_shape(configured)
    return None


#: The command line's ``--shape`` help (``policy-study`` and ``replay``).
SHAPE_HELP = (
    "a generated trace's shape: fields of WorkloadShape (continue_beta_a, tenants, "
    "catalog_share, catalog_alpha, think_time_scale), e.g. think_time_scale=5,tenants=3; "
    "default: the calibrated shape"
)


_CATALOG_SIZE = 2_000
_MAX_TURNS = 40


@dataclass(frozen=True)
class WorkloadMix:
    """Shares of *sessions* of each kind, and the arrival process of session starts."""

    conversation: float = 1.0
    agent: float = 0.0
    document: float = 0.0
    bursty: bool = False


_MIXES = {
    "conversation": WorkloadMix(),
    "toolagent": WorkloadMix(conversation=0.0, agent=1.0),
    "documents": WorkloadMix(conversation=0.0, document=1.0),
    "production": WorkloadMix(conversation=0.55, agent=0.05, document=0.4, bursty=True),
}

# Mean requests per session of each kind that fall within a one-hour trace (measured on the
# generator, seeds 0-1; a conversation has 1.88 turns on average, but the long ones run past
# the hour): sets the rate of session starts that gives the target request rate.
_REQUESTS_PER_SESSION = {"conversation": 1.71, "agent": 8.2, "document": 1.19}


class _Ids:
    """Fresh block ids."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        start = self.next
        self.next += n
        return list(range(start, start + n))


@dataclass
class _Context:
    """A prompt under construction: ids of its full blocks (of ``block_tokens`` tokens) and
    the tokens of its partial one."""

    full: list[int]
    tail_tokens: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def copy(self) -> _Context:
        return _Context(list(self.full), self.tail_tokens, self.block_tokens)

    def append(self, tokens: int, ids: _Ids) -> None:
        total = self.tail_tokens + tokens
        self.full += ids.take(total // self.block_tokens)
        self.tail_tokens = total % self.block_tokens

    @property
    def tokens(self) -> int:
        return len(self.full) * self.block_tokens + self.tail_tokens

    def block_ids(self, ids: _Ids) -> tuple[int, ...]:
        # The partial block's tokens are this prompt's own: a fresh id.
        return tuple(self.full + ids.take(1)) if self.tail_tokens else tuple(self.full)


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


class _Generator:
    def __init__(self, seed: int, shape: WorkloadShape, block_tokens: int) -> None:
        self.shape = shape
        self.block_tokens = block_tokens
        self.rng = random.Random(seed)
        self.ids = _Ids()
        self.out: list[tuple[float, int, int, tuple[int, ...], str]] = []
        rng = self.rng
        # Per tenant: a system prompt (conversations, documents) and a tool prompt (agents).
        tenants = range(shape.tenants)
        self.system = [self._root(_lognormal(rng, 1_200, 0.6, 300, 6_000)) for _ in tenants]
        self.tools = [self._root(_lognormal(rng, 7_000, 0.4, 3_000, 16_000)) for _ in tenants]
        weights = [1.0 / (k + 1) ** 1.1 for k in tenants]
        self.tenant_weights = weights
        # Popular documents (a tenant's manuals, a trending paper): a Zipf catalog, each a
        # tenant's system prompt then the document, made when first asked about.
        self.catalog_weights = [1.0 / (k + 1) ** shape.catalog_alpha for k in range(_CATALOG_SIZE)]
        self.catalog: dict[int, _Context] = {}
        self.sessions = 0

    def _root(self, tokens: int) -> _Context:
        context = _Context([], 0, self.block_tokens)
        context.append(tokens, self.ids)
        return context

    def _delay_s(self, median_s: float, sigma: float, low_s: float, high_s: float) -> int:
        scale = self.shape.think_time_scale
        return _lognormal(self.rng, median_s * scale, sigma, low_s * scale, high_s * scale)

    def _tenant(self) -> int:
        return self.rng.choices(range(self.shape.tenants), self.tenant_weights)[0]

    def _emit(self, at_s: float, context: _Context, output: int, kind: str) -> None:
        label = f"{kind}{self.sessions}"  # the session: request ids name it
        self.out.append((at_s, context.tokens, output, context.block_ids(self.ids), label))

    def conversation(self, start_s: float) -> None:
        rng, ids = self.rng, self.ids
        context = self.system[self._tenant()].copy()
        first = _lognormal(rng, 1_200, 1.0, 30, 8_000)
        if rng.random() < 0.35:  # a pasted document or file with the first message
            first += _lognormal(rng, 9_000, 0.7, 2_000, 40_000)
        context.append(first, ids)
        at_s = start_s
        # This conversation's chance of another turn after each one (see the module docstring).
        beta_a = self.shape.continue_beta_a
        go_on = rng.betavariate(beta_a, beta_a + 1.0)
        turns = 1
        while turns < _MAX_TURNS and rng.random() < go_on:
            turns += 1
        for turn in range(turns):
            output = _lognormal(rng, 350, 0.7, 20, 2_000)
            self._emit(at_s, context, output, "chat")
            if turn + 1 == turns:
                break
            context.append(output + _lognormal(rng, 250, 1.0, 10, 4_000), ids)
            at_s += self._delay_s(60, 1.1, 5, 1_800)  # reading, typing, coming back

    def agent(self, start_s: float) -> None:
        rng, ids = self.rng, self.ids
        context = self.tools[self._tenant()].copy()
        context.append(_lognormal(rng, 600, 0.8, 50, 4_000), ids)  # the task
        at_s = start_s
        steps = 2 + int(rng.expovariate(1 / 7.0))
        for step in range(min(steps, 60)):
            action = _lognormal(rng, 150, 0.6, 20, 1_000)
            self._emit(at_s, context, action, "agent")
            if step + 1 == steps or context.tokens > 120_000:
                break
            context.append(action + _lognormal(rng, 900, 1.0, 50, 8_000), ids)  # + observation
            at_s += self._delay_s(4, 0.8, 0.5, 60)  # the tool runs

    def _catalog_document(self) -> _Context:
        rng = self.rng
        index = rng.choices(range(_CATALOG_SIZE), self.catalog_weights)[0]
        context = self.catalog.get(index)
        if context is None:
            context = self.system[self._tenant()].copy()
            context.append(_lognormal(rng, 14_000, 0.6, 8_000, 64_000), self.ids)
            self.catalog[index] = context
        return context

    def document(self, start_s: float) -> None:
        rng, ids = self.rng, self.ids
        if rng.random() < self.shape.catalog_share:
            context = self._catalog_document()
        else:  # a one-off upload
            context = self.system[self._tenant()].copy()
            context.append(_lognormal(rng, 14_000, 0.6, 8_000, 64_000), ids)
        at_s = start_s
        asks = 1 + (rng.random() < 0.15) + (rng.random() < 0.05)
        for ask in range(asks):
            output = _lognormal(rng, 300, 0.6, 20, 1_500)
            question = context.copy()
            question.append(_lognormal(rng, 80, 0.8, 10, 800), ids)
            self._emit(at_s, question, output, "doc")
            if ask + 1 < asks:
                at_s += self._delay_s(90, 1.0, 5, 1_200)


def _session_starts(
    rng: random.Random, rate_per_s: float, duration_s: float, bursty: bool
) -> list[float]:
    """Session start times: Poisson, or a two-state Markov-modulated Poisson process (bursts
    at three times the calm rate, ~2-minute bursts every ~8 minutes) of the same mean rate."""
    starts: list[float] = []
    at_s = 0.0
    if not bursty:
        while True:
            at_s += rng.expovariate(rate_per_s)
            if at_s >= duration_s:
                return starts
            starts.append(at_s)
    burst_s, calm_s = 120.0, 360.0
    calm_rate = rate_per_s * (burst_s + calm_s) / (3 * burst_s + calm_s)
    in_burst = False
    while at_s < duration_s:
        length = rng.expovariate(1 / (burst_s if in_burst else calm_s))
        rate = calm_rate * (3 if in_burst else 1)
        end = min(duration_s, at_s + length)
        while True:
            at_s += rng.expovariate(rate)
            if at_s >= end:
                break
            starts.append(at_s)
        at_s = end
        in_burst = not in_burst
    return starts


def generate(
    mix: WorkloadMix,
    duration_s: float = 3_600.0,
    requests_per_hour: float = _REQUESTS_PER_HOUR,
    seed: int = 0,
    shape: WorkloadShape | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[BlockRequest]:
    """Requests of ``mix`` and ``shape`` (``None``: the calibrated one) arriving over
    ``duration_s`` at about ``requests_per_hour`` (requests a session would send after
    ``duration_s`` are dropped), by arrival time, in blocks of ``block_tokens`` tokens (the
    same prompts whatever the block size, for a seed)."""
    shares = {"conversation": mix.conversation, "agent": mix.agent, "document": mix.document}
    total = sum(shares.values())
    if total <= 0 or min(shares.values()) < 0:
        raise ConfigurationError(f"workload shares must be >= 0 and not all 0, got {shares}")
    if not duration_s > 0 or not requests_per_hour > 0:
        raise ConfigurationError(
            f"duration_s and requests_per_hour must be > 0, got {duration_s}, {requests_per_hour}"
        )
    if type(block_tokens) is not int or block_tokens <= 0:
        raise ConfigurationError(f"block_tokens must be an int > 0, got {block_tokens!r}")
    gen = _Generator(seed, shape or _CALIBRATED, block_tokens)
    kinds = [k for k, share in shares.items() if share > 0]
    weights = [shares[k] / total for k in kinds]
    per_session = sum(w * _REQUESTS_PER_SESSION[k] for k, w in zip(kinds, weights, strict=True))
    session_rate = requests_per_hour / 3_600.0 / per_session
    makers: dict[str, Callable[[float], None]] = {
        "conversation": gen.conversation,
        "agent": gen.agent,
        "document": gen.document,
    }
    for start in _session_starts(gen.rng, session_rate, duration_s, mix.bursty):
        gen.sessions += 1
        makers[gen.rng.choices(kinds, weights)[0]](start)
    kept = sorted((r for r in gen.out if r[0] < duration_s), key=lambda r: r[0])
    return [
        BlockRequest(f"{kind}-s{seed}-{i}", at_s, tokens, output, ids)
        for i, (at_s, tokens, output, ids, kind) in enumerate(kept)
    ]


def workload_trace(
    name: str,
    scale: str = "demo",
    seed: int = 0,
    shape: WorkloadShape | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[BlockRequest]:
    """The built-in realistic trace ``name`` at ``scale`` (see the module docstring), of
    ``shape`` (``None``: the calibrated one), in blocks of ``block_tokens`` tokens."""
    if name not in _MIXES:
        raise ConfigurationError(
            f"unknown realistic trace {name!r}; valid names: {', '.join(WORKLOAD_TRACES)}"
        )
    if scale not in _SCALE_HOURS:
        raise ConfigurationError(
            f"unknown trace scale {scale!r}; valid scales: {', '.join(_SCALE_HOURS)}"
        )
    duration_s = 3_600.0 * _SCALE_HOURS[scale]
    return generate(
        _MIXES[name], duration_s=duration_s, seed=seed, shape=shape, block_tokens=block_tokens
    )

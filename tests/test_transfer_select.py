"""``copy_backend="auto"`` per direction, on CUDA caches with a pinned pool (run anywhere: the
strategies are stood in for, so the order and the fallbacks are checked without a GPU)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tiering.errors import ConfigurationError
from tiering.transfer import select
from tiering.transfer.strategy import Direction, StrategyName


def fake_geometry(pinned: bool = True) -> Any:
    return SimpleNamespace(device=torch.device("cuda", 0), pool=SimpleNamespace(is_pinned=pinned))


def stand_ins(monkeypatch: pytest.MonkeyPatch, working: set[str]) -> list[str]:
    built: list[str] = []

    def build(name: StrategyName, geometry: Any, options: Any) -> Any:
        if name not in working:
            raise ConfigurationError(f"{name} cannot work here")
        built.append(name)
        return SimpleNamespace(name=name)

    monkeypatch.setattr(select, "_build", build)
    return built


def choose(direction: Any, backend: Any = "auto", pinned: bool = True) -> select.StrategyChoice:
    return select.make_strategy(fake_geometry(pinned), backend, direction=direction)[1]


def test_auto_loads_with_the_kernel_and_stores_with_the_copy_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_ins(monkeypatch, {"triton", "batched_memcpy", "staging"})
    load, store = choose("load"), choose("store")
    assert (load.name, load.reason) == ("triton", "fastest available")
    assert store.name == "batched_memcpy"
    assert store.reason == "the copy engine leaves the SMs to the engine's kernels"


@pytest.mark.parametrize(
    ("working", "load", "store"),
    [
        ({"triton", "staging"}, "triton", "triton"),  # a driver older than CUDA 12.8
        ({"batched_memcpy", "staging"}, "batched_memcpy", "batched_memcpy"),  # no Triton
        ({"staging"}, "staging", "staging"),
    ],
)
def test_auto_falls_back_in_each_direction_and_says_what_it_skipped(
    monkeypatch: pytest.MonkeyPatch, working: set[str], load: str, store: str
) -> None:
    stand_ins(monkeypatch, working)
    directions: tuple[tuple[Direction, str], ...] = (("load", load), ("store", store))
    for direction, expected in directions:
        choice = choose(direction)
        assert choice.name == expected
        order = select._AUTO_ORDER[direction]
        skipped_names = list(itertools.takewhile(lambda n: n not in working, order))
        for name in skipped_names:
            assert f"{name}: {name} cannot work here" in choice.reason
        assert choice.reason.startswith("fastest available (") == bool(skipped_names)


def test_a_named_strategy_or_an_unpinned_pool_is_the_same_in_both_directions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_ins(monkeypatch, {"triton", "batched_memcpy", "staging"})
    for direction in ("load", "store"):
        assert choose(direction, "triton") == select.StrategyChoice("triton", "requested")
        assert choose(direction, pinned=False).name == "staging"


def test_a_bad_direction_is_refused_naming_the_valid_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = stand_ins(monkeypatch, {"triton", "batched_memcpy", "staging"})
    with pytest.raises(ConfigurationError, match=r"'store' or 'load', got 'sideways'"):
        choose("sideways")
    assert built == []

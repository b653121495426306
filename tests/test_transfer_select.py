"""``copy_backend="auto"`` on CUDA caches with a pinned pool, and ``store_copy_backend``: run
anywhere, the strategies stood in for, so the order and the fallbacks are checked without a
GPU (tests/test_transfer_cuda.py runs the real ones)."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tiering.config import parse_config
from tiering.errors import ConfigError, ConfigurationError
from tiering.transfer import select
from tiering.transfer.strategy import StrategyName

AUTO_ORDER = ("triton", "batched_memcpy")  # the module docstring's order, staging last


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


def choose(backend: Any = "auto", pinned: bool = True) -> select.StrategyChoice:
    return select.make_strategy(fake_geometry(pinned), backend)[1]


@pytest.mark.parametrize(
    ("working", "expected"),
    [
        ({"triton", "batched_memcpy", "staging"}, "triton"),
        ({"batched_memcpy", "staging"}, "batched_memcpy"),  # no Triton
        ({"triton", "staging"}, "triton"),  # a driver older than CUDA 12.8
        ({"staging"}, "staging"),
    ],
)
def test_auto_takes_the_fastest_that_works_and_says_what_it_skipped(
    monkeypatch: pytest.MonkeyPatch, working: set[str], expected: str
) -> None:
    stand_ins(monkeypatch, working)
    choice = choose()
    assert choice.name == expected
    skipped = list(itertools.takewhile(lambda n: n not in working, AUTO_ORDER))
    assert choice.reason.startswith("fastest available")
    for name in skipped:
        assert f"{name}: {name} cannot work here" in choice.reason


def test_a_name_is_taken_as_asked_and_an_unpinned_pool_gets_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_ins(monkeypatch, {"triton", "batched_memcpy", "staging"})
    assert choose("batched_memcpy") == select.StrategyChoice("batched_memcpy", "requested")
    assert choose(pinned=False).name == "staging"


def parse(tmp_path: Path, primary: dict[str, Any]) -> Any:
    return parse_config(
        {"version": 1, "primary": {"capacity": "1MiB", **primary}},
        source=str(tmp_path / "t.yaml"),
    )


def test_store_copy_backend_is_read_from_the_config(tmp_path: Path) -> None:
    assert parse(tmp_path, {}).primary.store_copy_backend == "same"
    config = parse(tmp_path, {"store_copy_backend": "batched_memcpy"})
    assert config.primary.store_copy_backend == "batched_memcpy"
    with pytest.raises(ConfigError, match=r"store_copy_backend.*'same'.*'batched_memcpy'"):
        parse(tmp_path, {"store_copy_backend": "auto"})

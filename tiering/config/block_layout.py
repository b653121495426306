"""What every tier of a config stores: blocks of one size under one layout fingerprint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tiering.backends.ownership import LayoutRecord
from tiering.config.schema import TieringConfig
from tiering.core.block_format import make_layout_fingerprint


@dataclass(frozen=True)
class BlockLayout:
    """What every tier of a config stores: blocks of ``block_bytes`` under ``fingerprint``."""

    block_bytes: int  # one offloaded block over all ranks (one CPU pool row)
    fingerprint: bytes
    description: Mapping[str, Any] | None = None  # what the fingerprint stands for

    def record(self) -> LayoutRecord:
        return LayoutRecord(self.block_bytes, self.fingerprint, self.description)


def layout_for_config(config: TieringConfig) -> BlockLayout:
    """The block size, layout fingerprint and layout description ``config.model`` gives
    (:class:`ConfigError` if the config has no model)."""
    description = config.layout_description()
    return BlockLayout(config.block_bytes(), make_layout_fingerprint(description), description)

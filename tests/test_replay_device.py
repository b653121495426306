"""`tiering replay --device`: the simulated engine's KV caches on CPU or CUDA.

On CUDA the whole data path runs end to end (GPU KV -> pinned pool -> tiers -> pool -> GPU
KV), every loaded block verified; that test is skipped without CUDA. Without CUDA, asking for
it is a clear error before anything is built.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiering.cli import main as cli_main
from tiering.config import TieringConfig, parse_config
from tiering.errors import ConfigError
from tiering.replay import ReplayOptions, run_replay


def hybrid_config(tmp_path: Path, copy_backend: str = "auto") -> TieringConfig:
    return parse_config(
        {
            "version": 1,
            "model": {"shape": "tiny-hybrid"},
            "primary": {"capacity": "1MiB", "copy_backend": copy_backend},
            "secondary_tiers": [
                {"name": "nvme", "type": "file", "capacity": "4MiB", "path": "nvme"}
            ],
        },
        source=str(tmp_path / "tiering.yaml"),
        base_dir=tmp_path,
        env={},
    )


def options(device: str) -> ReplayOptions:
    return ReplayOptions(
        trace="chat", scale="tiny", seed=1, engine_blocks=512, progress=False, device=device
    )


@pytest.mark.parametrize("copy_backend", ["auto", "staging"])
def test_replay_on_cpu_caches_reports_its_device_and_strategy(
    tmp_path: Path, copy_backend: str
) -> None:
    report = run_replay(hybrid_config(tmp_path, copy_backend), options("cpu"))
    assert report["device"] == "cpu" and report["verify_failures"] == 0
    assert report["copy_strategy"] == ("memmove" if copy_backend == "auto" else copy_backend)
    assert report["prefill_tokens_saved"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_cuda_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"--device 'cuda' needs CUDA, but torch .* sees no"):
        run_replay(hybrid_config(tmp_path), options("cuda"))
    assert not (tmp_path / "nvme").exists()  # nothing was built
    path = tmp_path / "tiering.yaml"
    path.write_text("version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n")
    status = cli_main(["replay", "--config", str(path), "--device", "cuda", "--no-progress"])
    assert status == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_a_device_that_is_not_one_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--device 'gpu' is not a device; use cpu or cuda"):
        run_replay(hybrid_config(tmp_path), options("gpu"))
    with pytest.raises(ConfigError, match=r"--device 'meta': the replay puts KV caches on cpu"):
        run_replay(hybrid_config(tmp_path), options("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("copy_backend", ["auto", "staging"])
def test_replay_on_cuda_runs_the_whole_data_path_bit_exact(
    tmp_path: Path, copy_backend: str
) -> None:
    on_gpu = run_replay(hybrid_config(tmp_path / "gpu", copy_backend), options("cuda"))
    on_cpu = run_replay(hybrid_config(tmp_path / "cpu"), options("cpu"))
    assert on_gpu["device"] == "cuda:0" and on_gpu["verify_failures"] == 0
    assert on_gpu["copy_strategy"] != "memmove"
    for key in ("prefill_tokens_saved", "block_hit_ratio", "blocks_looked_up"):
        assert on_gpu[key] == on_cpu[key]

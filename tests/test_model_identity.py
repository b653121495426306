"""The checkpoint is part of a block's identity: two checkpoints of one architecture (same
config.json, other weights) never serve each other's blocks, in a persistent tier reopened by
another manager; copies of one checkpoint do share them; the weights are never read whole."""

from __future__ import annotations

import builtins
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tiering import cli
from tiering.config import build_manager, build_pool, load_config
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigError, TieringError
from tiering.model import identity as model_identity_module
from tiering.model.identity import SAMPLE_BYTES, SAMPLES, checkpoint_digest, model_identity

CONFIG = {  # a tiny Llama: 2 layers, 2 KV heads of 16, float16: 4 KiB per 16-token block
    "_name_or_path": "tiny-llama",
    "model_type": "llama",
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "torch_dtype": "float16",
}
NUM_BLOCKS = 8


def safetensors_bytes(header: dict[str, Any], data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def write_checkpoint(directory: Path, header: dict[str, Any], data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    (directory / "model.safetensors").write_bytes(safetensors_bytes(header, data))
    return directory / "config.json"


HEADER_A = {"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}
HEADER_B = {"__metadata__": {"format": "pt", "finetune": "1"}, **HEADER_A}


def write_yaml(tmp_path: Path, config_json: Path, name: str, extra: str = "") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        "version: 1\n"
        f"model: {{config_json: {config_json}{extra}}}\n"
        "primary: {capacity: 64KiB}\n"
        "secondary_tiers:\n"
        "  - {name: nvme, type: file, capacity: 1MiB, path: nvme, on_layout_mismatch: set_aside}\n"
    )
    return path


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def store(config_path: Path) -> dict[int, bytes]:
    config = load_config(config_path)
    pool = build_pool(config)
    rows = pool.rows_view()
    manager = build_manager(config, pool=pool)
    stored = {}
    try:
        manager.wait_ready()
        keys = [key(i) for i in range(NUM_BLOCKS)]
        out = manager.prepare_store(keys)
        assert out is not None and out.keys_to_store == keys
        generator = torch.Generator().manual_seed(3)
        for i, slot in enumerate(out.store_spec.block_ids.tolist()):
            rows[slot] = torch.randint(
                0, 256, (rows.shape[1],), dtype=torch.uint8, generator=generator
            )
            stored[i] = rows[slot].numpy().tobytes()
        manager.complete_store(keys)
        manager.wait_idle()
        assert len(manager.tiers[0]) == NUM_BLOCKS
    finally:
        manager.shutdown()
    return stored


def load_after_reopen(config_path: Path) -> dict[int, bytes]:
    """A fresh manager on the same tier directory: every block it serves, by id."""
    config = load_config(config_path)
    pool = build_pool(config)
    rows = pool.rows_view()
    manager = build_manager(config, pool=pool)
    served = {}
    try:
        manager.wait_ready()
        keys = [key(i) for i in range(NUM_BLOCKS)]
        manager.lookup_prefix(keys)
        manager.wait_idle()
        for i, k in enumerate(keys):
            if manager.lookup(k) is True:
                slot = int(manager.prepare_load([k]).block_ids[0])
                served[i] = rows[slot].numpy().tobytes()
                manager.complete_load([k])
    finally:
        manager.shutdown()
    return served


def test_two_checkpoints_of_one_architecture_never_share_blocks(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "base", HEADER_A, b"\x01" * 8)
    b = write_checkpoint(tmp_path / "finetune", HEADER_B, b"\x01" * 8)
    yaml_a, yaml_b = write_yaml(tmp_path, a, "a"), write_yaml(tmp_path, b, "b")
    assert load_config(yaml_a).fingerprint() != load_config(yaml_b).fingerprint()
    stored = store(yaml_a)
    assert load_after_reopen(yaml_a) == stored  # the same checkpoint: every block, bit-exact
    # A copy of the checkpoint elsewhere is the same checkpoint: names and contents, not paths.
    shutil.copytree(tmp_path / "base", tmp_path / "copy")
    assert load_after_reopen(write_yaml(tmp_path, tmp_path / "copy" / "config.json", "c")) == (
        stored
    )
    # The other checkpoint: not one block, though the geometry is the same.
    assert load_after_reopen(yaml_b) == {}
    assert list(tmp_path.glob("nvme*"))  # the old blocks were set aside, not served
    # ... and the first checkpoint, opened again after it, finds nothing of the other's.
    store(yaml_b)
    assert load_after_reopen(yaml_a) == {}


def test_another_process_refuses_the_other_checkpoints_tier(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "base", HEADER_A, b"\x01" * 8)
    b = write_checkpoint(tmp_path / "finetune", HEADER_B, b"\x01" * 8)
    store(write_yaml(tmp_path, a, "a"))
    yaml_b = tmp_path / "refuse.yaml"
    yaml_b.write_text(write_yaml(tmp_path, b, "b").read_text().replace("set_aside", "refuse"))
    result = subprocess.run(
        [sys.executable, "-m", "tiering.cli", "config", "check", str(yaml_b)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "layout" in result.stderr
    with pytest.raises(TieringError):
        build_manager(load_config(yaml_b))


def test_a_finetune_with_identical_headers_differs_by_its_sampled_data(tmp_path: Path) -> None:
    header = {"w": {"dtype": "F16", "shape": [65536], "data_offsets": [0, 131072]}}
    data = bytes(131072)
    tuned = bytearray(data)
    tuned[70000] = 1  # one weight in the middle of the file
    write_checkpoint(tmp_path / "a", header, data)
    write_checkpoint(tmp_path / "b", header, bytes(tuned))
    digest_a = checkpoint_digest(tmp_path / "a")
    digest_b = checkpoint_digest(tmp_path / "b")
    assert digest_a is not None and digest_b is not None
    # Samples are spread evenly; this byte lies in one only if the spacing says so: check the
    # header-identical, same-size pair is at least told apart where a sample lands.
    step = (131072 - SAMPLE_BYTES) // (SAMPLES - 1)
    sampled = any(i * step <= 70000 < i * step + SAMPLE_BYTES for i in range(SAMPLES))
    assert (digest_a.digest != digest_b.digest) == sampled
    tuned_at_sample = bytearray(data)
    tuned_at_sample[3 * step] = 1
    write_checkpoint(tmp_path / "c", header, bytes(tuned_at_sample))
    digest_c = checkpoint_digest(tmp_path / "c")
    assert digest_c is not None and digest_c.digest != digest_a.digest


def test_the_weights_are_never_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    header = {"w": {"dtype": "F16", "shape": [1 << 29], "data_offsets": [0, 1 << 30]}}
    directory = tmp_path / "big"
    write_checkpoint(directory, header, b"")
    with open(directory / "model.safetensors", "r+b") as file:
        file.truncate(file.seek(0, 2) + (1 << 30))  # 1 GiB of (sparse) tensor data
    read_bytes = []
    real_open = builtins.open

    class Counting:
        def __init__(self, file: Any) -> None:
            self.file = file

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def read(self, n: int = -1) -> bytes:
            data: bytes = self.file.read(n)
            read_bytes.append(len(data))
            return data

        def seek(self, offset: int, whence: int = 0) -> int:
            return int(self.file.seek(offset, whence))

    def counting_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return Counting(real_open(path, mode, *args, **kwargs))

    monkeypatch.setattr(model_identity_module, "open", counting_open, raising=False)
    assert checkpoint_digest(directory) is not None
    header_bytes = len(json.dumps(header))
    assert sum(read_bytes) == 8 + header_bytes + SAMPLES * SAMPLE_BYTES


def test_weights_id_names_the_weights(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "base", HEADER_A, b"\x01" * 8)
    b = write_checkpoint(tmp_path / "finetune", HEADER_B, b"\x01" * 8)
    v1_a = load_config(write_yaml(tmp_path, a, "a1", ", weights_id: v1"))
    v1_b = load_config(write_yaml(tmp_path, b, "b1", ", weights_id: v1"))
    v2_a = load_config(write_yaml(tmp_path, a, "a2", ", weights_id: v2"))
    derived = load_config(write_yaml(tmp_path, a, "a"))
    assert v1_a.fingerprint() == v1_b.fingerprint()  # what the operator says, not the files
    assert len({v1_a.fingerprint(), v2_a.fingerprint(), derived.fingerprint()}) == 3
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        "version: 1\nmodel: {shape: tiny, weights_id: r1}\nprimary: {capacity: 1MiB}\n"
    )
    plain = tmp_path / "plain.yaml"
    plain.write_text("version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 1MiB}\n")
    assert load_config(preset).fingerprint() != load_config(plain).fingerprint()
    for bad in ("''", '"a\\tb"', "'" + "x" * 300 + "'", "[1]"):
        path = tmp_path / "bad.yaml"
        path.write_text(
            f"version: 1\nmodel: {{shape: tiny, weights_id: {bad}}}\nprimary: {{capacity: 1MiB}}\n"
        )
        with pytest.raises(ConfigError, match=r"model\.weights_id"):
            load_config(path)


def test_a_broken_weight_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    config_json = write_checkpoint(tmp_path / "m", HEADER_A, b"\x01" * 8)
    (tmp_path / "m" / "model-00002.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ConfigError, match=r"model-00002\.safetensors: not a safetensors file"):
        model_identity("m", config_json=config_json)


@pytest.mark.parametrize("with_weights", [True, False])
def test_config_check_and_doctor_print_the_identity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], with_weights: bool
) -> None:
    if with_weights:
        config_json = write_checkpoint(tmp_path / "m", HEADER_A, b"\x01" * 8)
    else:
        (tmp_path / "m").mkdir()
        config_json = tmp_path / "m" / "config.json"
        config_json.write_text(json.dumps(CONFIG))
    yaml = write_yaml(tmp_path, config_json, "t")
    assert cli.main(["config", "check", str(yaml)]) == 0
    check = capsys.readouterr().out
    assert "model: tiny-llama," in check  # the name, never None
    cli.main(["doctor", "--json", "--config", str(yaml)])
    doctor = json.loads(capsys.readouterr().out)
    (identity,) = [c for c in doctor["checks"] if c["name"] == "model identity"]
    if with_weights:
        digest = model_identity("x", config_json=config_json).weights
        assert digest is not None and digest.startswith("sha256:")
        assert f"model identity: tiny-llama, weights {digest} (1 weight file(s)" in check
        assert identity["status"] == "OK" and digest in identity["message"]
    else:
        assert "model identity (WARN): tiny-llama, weights unknown: no weight files" in check
        assert "architecture alone" in check and "keep the weights beside config.json" in check
        assert identity["status"] == "WARN" and "architecture alone" in identity["message"]

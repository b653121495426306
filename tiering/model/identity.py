"""Which checkpoint a block's KV came from: the weights part of the layout fingerprint.

Two checkpoints of one architecture (a base model and its fine-tune, two revisions) have the
same geometry but different KV for the same tokens, so the fingerprint every tier checks on read
covers the checkpoint too. It is either given (``model.weights_id`` in the config: whatever
names the weights, e.g. a commit hash) or derived from the files beside ``config.json``, without
reading the weights whole:

- ``config.json`` itself (RoPE scaling and other fields change the KV too),
- ``model.safetensors.index.json``, if present,
- every ``*.safetensors`` file: its size, its header (the first 8 bytes give the header's length,
  then the JSON header: tensor names, dtypes, shapes, offsets) and ``SAMPLES`` slices of
  ``SAMPLE_BYTES`` spread evenly over its tensor data (a fine-tune keeps names and shapes, not
  values),
- other weight files (``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): size and their last
  ``SAMPLE_BYTES`` (a torch zip file ends with its directory, with a CRC of every record).

A checkpoint with no weight files beside its config has an identity of the architecture alone:
``tiering config check`` and ``tiering doctor`` warn about it. File names and contents only, not
paths or times: copies of one checkpoint on two hosts share their blocks.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tiering.errors import ConfigError

__all__ = [
    "SAMPLES",
    "SAMPLE_BYTES",
    "CheckpointDigest",
    "ModelIdentity",
    "checkpoint_digest",
    "model_identity",
    "weights_id_problem",
]

SAMPLES = 8
SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit
MAX_INDEX_BYTES = 64 << 20
MAX_WEIGHT_FILES = 100_000
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointDigest:
    """What :func:`checkpoint_digest` read: the digest and a line for people."""

    digest: str  # "sha256:" + 32 hex digits
    files: int
    total_bytes: int


@dataclass(frozen=True)
class ModelIdentity:
    """The model part of a layout fingerprint: its name, and what names its weights."""

    name: str
    #: "weights_id" (given in the config), "checkpoint" (derived from the files) or
    #: "architecture" (nothing names the weights: checkpoints of one architecture share blocks)
    source: str
    weights: str | None  # the weights_id or the checkpoint digest
    config_digest: str | None = None  # sha256 of config.json, when there is one
    detail: str = ""

    @property
    def architecture_only(self) -> bool:
        return self.source == "architecture"

    def fingerprint_part(self) -> dict[str, object] | None:
        """What goes into the layout fingerprint (None for a built-in shape with no
        weights_id: nothing but the architecture to name)."""
        if self.weights is None and self.config_digest is None:
            return None
        return {
            "source": self.source,
            "weights": self.weights,
            "config": self.config_digest,
        }

    def describe(self) -> str:
        """One line: the name, then what names the weights (or a warning that nothing does)."""
        if self.source == "weights_id":
            return f"{self.name}, weights {self.weights!r} (model.weights_id)"
        if self.source == "checkpoint":
            return f"{self.name}, weights {self.weights} ({self.detail})"
        remedy = "set model.weights_id"
        if self.config_digest is not None:
            remedy += " or keep the weights beside config.json"
        return (
            f"{self.name}, weights unknown: {self.detail}; the identity rests on the "
            "architecture alone, so checkpoints of this architecture (a base model and its "
            f"fine-tunes, revisions) share blocks: {remedy}"
        )


MAX_WEIGHTS_ID_CHARS = 256


def weights_id_problem(weights_id: object) -> str | None:
    """Why ``weights_id`` cannot name weights (None if it can): a printable string, 1 to 256
    characters."""
    if not isinstance(weights_id, str) or not weights_id.strip():
        return f"{weights_id!r:.60} is not a non-empty string"
    if len(weights_id) > MAX_WEIGHTS_ID_CHARS or not weights_id.isprintable():
        return f"must be 1 to {MAX_WEIGHTS_ID_CHARS} printable characters"
    return None


def model_identity(
    name: str, *, config_json: Path | None = None, weights_id: str | None = None
) -> ModelIdentity:
    """The identity of the model ``name``: ``weights_id`` if given, else derived from the files
    beside ``config_json`` (:func:`checkpoint_digest`), else the architecture alone."""
    config_digest = None
    if config_json is not None:
        config_digest = _file_sha256(config_json)
    if weights_id is not None:
        return ModelIdentity(name, "weights_id", weights_id, config_digest)
    if config_json is None:
        return ModelIdentity(name, "architecture", None, None, "a built-in model shape")
    found = checkpoint_digest(config_json.parent)
    if found is None:
        detail = f"no weight files beside {config_json.name} in {config_json.parent}"
        return ModelIdentity(name, "architecture", None, config_digest, detail)
    detail = f"{found.files} weight file(s), {found.total_bytes} bytes, beside {config_json.name}"
    return ModelIdentity(name, "checkpoint", found.digest, config_digest, detail)


def checkpoint_digest(directory: Path) -> CheckpointDigest | None:
    """The digest of the weight files in ``directory`` (see the module docstring), or None if
    there are none. Read again only when a file's size or modification time changes.

    Raises :class:`ConfigError` naming the file if one cannot be read or is not what its name
    says (a safetensors header longer than the file)."""
    entries: list[tuple[str, int, int]] = []
    try:
        with os.scandir(directory) as scan:
            for entry in scan:
                name = entry.name
                if name != INDEX_NAME and not name.endswith((".safetensors", *_OTHER_WEIGHTS)):
                    continue
                if not entry.is_file():  # follows links: the Hugging Face cache links to blobs
                    continue
                stat = entry.stat()
                entries.append((name, stat.st_size, stat.st_mtime_ns))
                if len(entries) > MAX_WEIGHT_FILES:
                    raise ConfigError(f"{directory}: over {MAX_WEIGHT_FILES} weight files")
    except OSError as exc:
        raise ConfigError(
            f"{directory}: cannot list the checkpoint: {exc.strerror or exc}"
        ) from None
    if not any(name != INDEX_NAME for name, _, _ in entries):
        return None
    return _digest(str(directory), tuple(sorted(entries)))


@functools.lru_cache(maxsize=16)
def _digest(directory: str, entries: tuple[tuple[str, int, int], ...]) -> CheckpointDigest:
    total = hashlib.sha256(b"tiering checkpoint v1\0")
    weight_files, weight_bytes = 0, 0
    for name, size_bytes, _mtime_ns in entries:
        path = os.path.join(directory, name)
        total.update(f"{name}\0{size_bytes}\0".encode())
        if name == INDEX_NAME:
            total.update(_file_sha256(Path(path)).encode())
            continue
        weight_files += 1
        weight_bytes += size_bytes
        try:
            with open(path, "rb") as file:
                if name.endswith(".safetensors"):
                    _safetensors_part(file, path, size_bytes, total.update)
                else:
                    file.seek(max(0, size_bytes - SAMPLE_BYTES))
                    total.update(file.read(SAMPLE_BYTES))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the weights: {exc.strerror or exc}") from None
    return CheckpointDigest("sha256:" + total.hexdigest()[:32], weight_files, weight_bytes)


def _safetensors_part(
    file: BinaryIO, path: str, size_bytes: int, update: Callable[[bytes], object]
) -> None:
    prefix = file.read(8)
    if len(prefix) < 8:
        raise ConfigError(f"{path}: not a safetensors file: {size_bytes} bytes, no header")
    (header_bytes,) = struct.unpack("<Q", prefix)
    if header_bytes > MAX_HEADER_BYTES or 8 + header_bytes > size_bytes:
        raise ConfigError(
            f"{path}: not a safetensors file: a {header_bytes}-byte header in {size_bytes} bytes"
        )
    header = file.read(header_bytes)
    update(hashlib.sha256(header).digest())
    data_start, data_bytes = 8 + header_bytes, size_bytes - 8 - header_bytes
    if data_bytes <= SAMPLES * SAMPLE_BYTES:
        update(file.read(data_bytes))
        return
    step = (data_bytes - SAMPLE_BYTES) // (SAMPLES - 1)
    for i in range(SAMPLES):
        file.seek(data_start + i * step)
        update(file.read(SAMPLE_BYTES))


def _file_sha256(path: Path) -> str:
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_INDEX_BYTES:
        raise ConfigError(f"{path}: over {MAX_INDEX_BYTES >> 20} MiB")
    return "sha256:" + hashlib.sha256(data).hexdigest()[:32]

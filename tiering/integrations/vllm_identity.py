"""Which checkpoint a vLLM engine serves: the model part of the drop-in's layout fingerprint.

vLLM 0.33 hands an offloading spec only its ``OffloadingConfig``, whose model part is the model's
name or path and the KV-cache dtype: two revisions of one repository, a quantized and a full
checkpoint, or a fine-tune stored under the same path would share blocks. The rest is in vLLM's
``ModelConfig``, which the connector holds while it builds the spec and its manager
(``OffloadingConnector.__init__`` and ``OffloadingConnectorScheduler.__init__`` take the
``VllmConfig``): :func:`engine_model_config` finds it there (or in vLLM's current-config context,
in a worker). From it, the identity covers:

- the model (path or repository name), ``revision``, ``quantization`` and the model ``dtype``
  vLLM resolved;
- the checkpoint's files (:mod:`tiering.model.identity`: ``config.json``, the safetensors index,
  each file's header, size and sampled data) when the model is a local directory, or when a
  repository's snapshot for that revision is in the local Hugging Face cache (where vLLM
  downloaded it).

Without an engine ``ModelConfig`` (a spec built outside vLLM's connector) the identity is the
name from the ``OffloadingConfig`` and the checkpoint files found from it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.v1.kv_offload.base import OffloadingSpec

from tiering.errors import TieringError
from tiering.model.identity import model_identity

__all__ = ["engine_model_config", "model_identity_of"]

log = logging.getLogger(__name__)

_MAX_FRAMES = 32  # the connector is a few calls above the spec and its tiers
_ATTRIBUTE = "_tiering_model_identity"


def engine_model_config(model_name: str) -> Any | None:
    """vLLM's ``ModelConfig`` of the engine building a spec for ``model_name``: from the
    current-config context, else from the ``vllm_config`` argument of a caller (the connector
    that builds the spec and its manager); None if neither holds one for this model."""
    candidates: list[Any] = [get_current_vllm_config_or_none()]
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        candidates.append(frame.f_locals.get("vllm_config"))
        frame = frame.f_back
    for candidate in candidates:
        if isinstance(candidate, VllmConfig) and candidate.model_config is not None:
            if str(candidate.model_config.model) == model_name:
                return candidate.model_config
    return None


def model_identity_of(spec: OffloadingSpec) -> dict[str, object]:
    """The model part of ``spec``'s layout fingerprint (see the module docstring), computed
    once per spec (the first call should come while vLLM's connector builds it)."""
    cached = getattr(spec, _ATTRIBUTE, None)
    if isinstance(cached, dict):
        return cached
    name = spec.config.model.name
    model_config = engine_model_config(name)
    revision = quantization = dtype = None
    if model_config is not None:
        revision = model_config.revision
        quantization = model_config.quantization
        dtype = str(model_config.dtype).removeprefix("torch.")
    directory = _checkpoint_directory(name, revision)
    weights = None
    if directory is not None:
        try:
            found = model_identity(name, config_json=directory / "config.json")
        except TieringError as exc:  # unreadable: name it, and key on what is left
            log.warning("tiering: the checkpoint's files do not name its weights: %s", exc)
        else:
            weights = found.fingerprint_part()
    identity: dict[str, object] = {
        "model": name,
        "revision": None if revision is None else str(revision),
        "quantization": None if quantization is None else str(quantization),
        "model_dtype": dtype,
        "engine_model_config": model_config is not None,
        "checkpoint": weights,
    }
    if weights is None or not weights.get("weights"):  # info: a spec is built per tier
        log.info(
            "tiering: the layout fingerprint names model %r (revision %s) but not its weights "
            "(no weight files found): checkpoints stored under this name share blocks",
            name,
            revision,
        )
    setattr(spec, _ATTRIBUTE, identity)
    return identity


def _checkpoint_directory(name: str, revision: str | None) -> Path | None:
    """The local directory of the checkpoint ``name`` at ``revision``: the path itself, or the
    Hugging Face cache's snapshot of the repository (None if neither has a config.json)."""
    path = Path(name)
    if (path / "config.json").is_file():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(name, "config.json", revision=revision or "main")
    except ValueError:  # a name that is no repository id: nothing cached under it
        return None
    return Path(found).parent if isinstance(found, str) else None

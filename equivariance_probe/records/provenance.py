"""What a result was measured on: fingerprints of the model, the corpus and the configuration.

Place in the seams: *records*. Checkpoints are refused when any of the three fingerprints
differs from the run that wants to resume them, and shards merge only when they share a
model, a corpus and a configuration (:mod:`equivariance_probe.records.sharding`).

* :func:`model_identity` — class, ``_name_or_path``, the hub commit hash when the model came
  from the hub cache, a hash of its config, dtype, device, parameter count and a hash of a
  fixed strided sample of every weight tensor (up to 65,536 values per tensor: cheap for a
  270M model, and two different checkpoints of one architecture differ in it).
* :func:`corpus_fingerprint` — sha256 over every document (text or token ids), in order.
* :func:`config_fingerprint` — sha256 of a JSON configuration with sorted keys.
* :func:`window_fingerprints` — a 64-bit fingerprint of each window's token ids, which results
  carry so that a merge never counts the same window twice.

Imports torch only; the Hugging Face model inside a wrapper is found with
:func:`~equivariance_probe.adapters.modules.hf_model_of`.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..adapters.modules import hf_model_of

__all__ = [
    "run_metadata",
    "model_identity",
    "model_revision",
    "corpus_fingerprint",
    "config_fingerprint",
    "window_fingerprint",
    "window_fingerprints",
    "library_versions",
]

#: Values hashed per weight tensor (a strided sample: first value, then every numel/N-th).
WEIGHT_SAMPLE = 65536


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_fingerprint(config: dict[str, Any]) -> str:
    """sha256 of ``config`` as JSON with sorted keys (non-JSON values by ``str``)."""
    return _sha256(json.dumps(config, sort_keys=True, default=str))


def corpus_fingerprint(docs: Iterable[Any]) -> dict[str, Any]:
    """``{"sha256", "n_docs"}`` of documents (strings, token tensors or lists of ids), in order.

    Each document enters the hash with its type and length, so ``["ab", "c"]`` and
    ``["a", "bc"]`` differ.
    """
    digest = hashlib.sha256()
    count = 0
    for doc in docs:
        count += 1
        if isinstance(doc, str):
            payload = doc.encode("utf-8")
            kind = b"s"
        elif isinstance(doc, torch.Tensor):
            payload = doc.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
            kind = b"t"
        else:
            payload = json.dumps(list(doc)).encode("utf-8")
            kind = b"l"
        digest.update(kind + len(payload).to_bytes(8, "little") + payload)
    return {"sha256": digest.hexdigest(), "n_docs": count}


def window_fingerprint(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> int:
    """64-bit fingerprint of one window: BLAKE2b with an 8-byte digest over its token ids as
    little-endian int64, read as a little-endian unsigned integer.

    A cryptographic hash of the bytes alone, so it is the same in every process, on every
    machine and in every language (Python's ``hash`` is salted per process); two different
    windows collide with probability ``2^-64`` (about ``n²/2^65`` among ``n`` windows). The
    length is part of the bytes, so a window and its prefix differ. Without this package::

        int.from_bytes(hashlib.blake2b(np.asarray(ids, "<i8").tobytes(), digest_size=8).digest(), "little")
    """
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().to("cpu", torch.int64).numpy()
    payload = np.ascontiguousarray(np.asarray(token_ids, dtype="<i8")).tobytes()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def window_fingerprints(rows: Iterable[Sequence[int] | np.ndarray | torch.Tensor]) -> np.ndarray:
    """``[n]`` uint64 :func:`window_fingerprint` of each window (a list of token ids per window)."""
    return np.array([window_fingerprint(row) for row in rows], dtype=np.uint64)


def _hf_model(model: Any) -> Any | None:
    try:
        return hf_model_of(model)
    except Exception:  # noqa: BLE001 - not a Hugging Face model (or transformers absent): no config to describe
        return None


def model_revision(model: Any) -> dict[str, Any]:
    """Which weights these are, as far as the model can tell: ``_name_or_path``, the hub commit
    hash (``config._commit_hash``, set when loaded from the hub cache) and a hash of the config."""
    hf = _hf_model(model)
    config = getattr(hf, "config", None) if hf is not None else getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {"class": type(model).__name__}
    described = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "_commit_hash", "transformers_version")}
    return {
        "class": type(hf if hf is not None else model).__name__,
        "name_or_path": str(getattr(config, "_name_or_path", "") or ""),
        "commit_hash": getattr(config, "_commit_hash", None),
        "config_sha256": config_fingerprint(described),
    }


def _weights_digest(module: torch.nn.Module) -> tuple[str, int, str, str]:
    digest = hashlib.sha256()
    n_parameters = 0
    dtype, device = "none", "none"
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            n_parameters += parameter.numel()
            dtype, device = str(parameter.dtype).replace("torch.", ""), str(parameter.device)
            digest.update(f"{name}|{tuple(parameter.shape)}|{parameter.dtype}|".encode())
            if parameter.device.type == "meta" or parameter.numel() == 0:
                continue  # remote nnsight models keep their weights on the server
            flat = parameter.detach().reshape(-1)
            step = max(1, flat.numel() // WEIGHT_SAMPLE)
            sample = flat[::step][:WEIGHT_SAMPLE].to("cpu").contiguous()
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), n_parameters, dtype, device


def model_identity(model: Any) -> dict[str, Any]:
    """Fingerprint of a model: :func:`model_revision` plus dtype, device, parameter count and a
    weights hash (a strided sample of every tensor). Equal for the same weights loaded twice."""
    identity = model_revision(model)
    module = _hf_model(model)
    if module is None and isinstance(model, torch.nn.Module):
        module = model
    if module is not None:
        weights, n_parameters, dtype, device = _weights_digest(module)
        identity.update(weights_sha256=weights, n_parameters=n_parameters, dtype=dtype, device=device)
    return identity


def library_versions() -> dict[str, str]:
    """Installed versions of the packages a result depends on."""
    import importlib.metadata

    versions = {}
    for package in ("equivariance-probe", "torch", "transformers", "transformer-lens", "nnsight", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run_metadata(adapter: Any, context_length: int, batch_size: int, min_tokens: int) -> dict[str, Any]:
    """What a run's result records of itself: a new run id, when, the model (name, framework, dtype, device,
    revision and a weights fingerprint), its layout, the window length, the batch and the protocol of the windows,
    and the libraries' versions."""
    info = adapter.info()
    layout = adapter.layout
    return {
        "run_id": uuid.uuid4().hex,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "name": info.name,
            "framework": info.framework,
            "dtype": info.dtype,
            "device": info.device,
            **info.extra,
            "revision": model_revision(adapter.model),
            # Which weights these are (a strided sample of every tensor): results of one model name
            # with other weights (a fine-tune, a random_init_like copy) refuse to merge.
            "weights_sha256": model_identity(adapter.model).get("weights_sha256"),
        },
        "layout": {
            "n_layers": layout.n_layers,
            "n_heads": layout.n_heads,
            "windows": list(layout.sliding_windows),
            "max_context": layout.max_context,
            "causal": layout.causal,
        },
        "context_length": context_length,
        "batch_size": batch_size,
        "min_tokens": min_tokens,
        "tokenisation": "each document tokenised with the model's tokenizer including its special tokens, "
        "truncated to its first context_length tokens; token tensors used as given",
        "versions": library_versions(),
    }

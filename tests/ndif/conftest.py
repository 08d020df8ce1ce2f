"""Fixtures of the NDIF server tests (run inside .venv-ndif by tests/test_ndif_server.py).

``ndif_server``: one NDIF stack for the module (see :mod:`ndif_stack`), nnsight's client pointed at
it (``CONFIG.API.HOST``, a key in ndif's UUID form; without a database ndif checks no key), and the
tiny Gemma 3 (sliding-window layers) saved to a folder with a word-level tokenizer and deployed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from ndif_stack import API_KEY, missing_components, new_stack  # noqa: E402


def tiny_tokenizer(vocab_size: int = 97):
    """A word-level tokenizer ("t0 t5 ...") built offline, saved beside the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0",
                                   bos_token="t1", eos_token="t2")


def save_model(hf_model, folder: Path) -> str:
    hf_model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def client_model(folder: str):
    """The client's model: config only (meta), keyed by the folder's path, as ndif deploy names it.

    nnsight canonicalises a model key through the Hub (``HfApi().model_info``), which a folder
    path fails; its cache is seeded with the path itself, the key ``ndif deploy`` gives a folder.
    """
    import nnsight.modeling.huggingface as hf_wrapper
    from nnsight import TransformersModel

    hf_wrapper._ID_CACHE[folder] = folder
    return TransformersModel(folder, task="text-generation")


class Server:
    def __init__(self, stack, folders: dict[str, str]):
        self.stack = stack
        self.folders = folders

    @property
    def url(self) -> str:
        return self.stack.url


@pytest.fixture(scope="module")
def ndif_server(tmp_path_factory):
    reason = missing_components()
    if reason is not None:
        pytest.skip(f"no NDIF server here: {reason}")
    import nnsight
    from synthetic import tiny_gemma3, tiny_llama

    folder = tmp_path_factory.mktemp("models")
    folders = {
        # window 8 on layers 0-1, full attention on layer 2; 4 query heads on 2 kv heads
        "gemma": save_model(tiny_gemma3(window=8, max_positions=1024), folder / "gemma"),
        "llama": save_model(tiny_llama(), folder / "llama"),  # never deployed
        "gemma_timeout": save_model(tiny_gemma3(window=8), folder / "gemma_timeout"),
        "gemma_short": save_model(tiny_gemma3(window=8), folder / "gemma_short"),  # a timeout of a few seconds
    }
    # Results over 1 MiB cannot ride Redis pub/sub back (ndif's inline cap follows this limit).
    stack = new_stack(pubsub_limit="0 1mb 60")
    previous = (nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY, nnsight.CONFIG.APP.REMOTE_LOGGING)
    try:
        stack.start()
        stack.deploy(client_model(folders["gemma"]).to_model_key(), folders["gemma"])
        nnsight.CONFIG.API.HOST = stack.url
        nnsight.CONFIG.API.APIKEY = API_KEY
        nnsight.CONFIG.APP.REMOTE_LOGGING = False
        yield Server(stack, folders)
    finally:
        nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY, nnsight.CONFIG.APP.REMOTE_LOGGING = previous
        stack.stop()


@pytest.fixture
def sent_and_received(monkeypatch):
    """Bytes of each request nnsight POSTs to the server and of each result it receives."""
    from nnsight.intervention.backends.remote import RemoteBackend

    traffic = {"sent": [], "received": []}
    post, finalize = RemoteBackend._post, RemoteBackend.finalize

    def spy_post(self, request, blob):
        traffic["sent"].append(len(blob))
        return post(self, request, blob)

    def spy_finalize(self, content):
        traffic["received"].append(len(content))
        return finalize(self, content)

    monkeypatch.setattr(RemoteBackend, "_post", spy_post)
    monkeypatch.setattr(RemoteBackend, "finalize", spy_finalize)
    return traffic


def token_windows(n_docs: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (n_docs, width), generator=torch.Generator().manual_seed(seed))

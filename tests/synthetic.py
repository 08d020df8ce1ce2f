"""Test doubles: an adapter that emits hand-made attention patterns, and tiny HF models.

Nothing here downloads anything: every model is built from a config with seeded
random (or zero) weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from equivariance_probe.adapters.base import Adapter, AttentionLayout
from equivariance_probe.adapters.passes import pattern_pass

#: pattern_fn(layer, tokens [batch, T]) -> pattern [batch, head, T, T]
PatternFunction = Callable[[int, torch.Tensor], torch.Tensor]


class SyntheticAdapter(Adapter):
    """An adapter whose "model" is a function from token windows to attention patterns."""

    framework = "synthetic"

    def __init__(self, pattern_fn: PatternFunction, *, n_layers: int, n_heads: int,
                 sliding_windows: Sequence[int | None] | None = None, max_context: int | None = None,
                 vocab_size: int = 1000) -> None:
        super().__init__(torch.nn.Linear(1, 1))
        self.pattern_fn = pattern_fn
        self._layout = AttentionLayout(n_layers, n_heads, tuple(sliding_windows or (None,) * n_layers), max_context)
        self._vocab = vocab_size

    @property
    def layout(self) -> AttentionLayout:
        return self._layout

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # Its binder: the only site it has is each layer's pattern, "weights.{l}".
    def check_plan(self, plan) -> None:
        from equivariance_probe.errors import SiteError

        for site in plan.sites():
            if site.kind != "weights":
                raise SiteError(f"the synthetic adapter has only 'weights.<layer>' sites, not {site.name!r}")

    def run_plan(self, tokens: torch.Tensor, plan, *, position_ids=None, attention_mask=None) -> dict:
        from equivariance_probe.adapters.plan import apply
        from equivariance_probe.adapters.sites import Site

        self.check_plan(plan)
        for layer in range(self._layout.n_layers):
            actions = plan.actions(Site("weights", layer))
            if actions and apply(actions, self.pattern_fn(layer, tokens))[2]:
                break
        return {"ablation": ()}


def causal_mask(n: int, window: int | None = None) -> torch.Tensor:
    """``[query, key]`` bool: ``k <= q`` and, for a window, ``q - k < window``."""
    q = torch.arange(n).view(-1, 1)
    k = torch.arange(n).view(1, -1)
    mask = k <= q
    if window is not None:
        mask &= q - k < window
    return mask


def uniform_pattern(n: int, window: int | None = None) -> torch.Tensor:
    """``a[q, k] = 1/|V(q)|`` on visible entries: ``[query, key]`` float32."""
    mask = causal_mask(n, window).float()
    return mask / mask.sum(-1, keepdim=True)


def lag_only_pattern(n: int, rate: float = 0.7) -> torch.Tensor:
    """``a[q, k] = rate^(q-k)`` for ``k <= q``: depends on ``q - k`` alone (not row-normalised)."""
    q = torch.arange(n).view(-1, 1)
    k = torch.arange(n).view(1, -1)
    return torch.where(k <= q, rate ** (q - k).float(), torch.zeros(()))


def random_causal_pattern(tokens: torch.Tensor, n_heads: int, window: int | None = None, seed: int = 0) -> torch.Tensor:
    """A softmax of scores that depend on token ids and positions: ``[batch, head, T, T]``."""
    batch, n = tokens.shape
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(n_heads, 64, 64, generator=generator)
    ids = tokens % 64
    scores = table[:, ids.unsqueeze(-1), ids.unsqueeze(-2)].permute(1, 0, 2, 3)  # [batch, head, T, T]
    scores = scores + 0.05 * torch.arange(n).float().view(1, 1, 1, -1)
    scores = scores.masked_fill(~causal_mask(n, window), float("-inf"))
    return torch.softmax(scores, -1)


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_head: int = 4, n_positions: int = 64, zero: bool = False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=32, vocab_size=97, n_positions=n_positions,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    if zero:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
    return model.eval()


def tiny_gemma3(seed: int = 0, window: int = 8, zero: bool = False, max_positions: int = 128):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=window, max_position_embeddings=max_positions,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    model = Gemma3ForCausalLM(config)
    if zero:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
    return model.eval()


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def tiny_jetmoe(seed: int = 0, max_positions: int = 64):
    """A tiny JetMoE (mixture-of-experts attention and MLP): an architecture whose TransformerLens 4 bridge keeps
    the Hugging Face attention module, so its ``hook_attn_scores`` fires with post-softmax weights."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    torch.manual_seed(seed)
    config = JetMoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2,
                          kv_channels=8, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=max_positions,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return JetMoeForCausalLM(config).eval()


def tiny_bert(seed: int = 0, zero: bool = False, max_positions: int = 64, attn_implementation: str = "eager"):
    """A tiny BERT encoder (``BertModel``: bidirectional attention, learned absolute positions)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=max_positions, pad_token_id=0)
    model = BertModel._from_config(config, attn_implementation=attn_implementation)
    if zero:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.zero_()
    return model.eval()


def collect_patterns(adapter: Adapter, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every layer's full pattern (only for tests: the probe never does this)."""
    patterns: dict[int, torch.Tensor] = {}
    pattern_pass(adapter, tokens, lambda layer, p: patterns.__setitem__(layer, p.detach().clone()))
    return patterns


WORDS = "the a of and to in is was for on as with by at from that which it his an were are".split()


def save_tiny_model_with_tokenizer(folder, kind: str = "gpt2", n_positions: int = 64) -> str:
    """A tiny random model and a word-level tokenizer saved with ``save_pretrained`` (offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<bos>": 1, "<eos>": 2}
    for word in WORDS + [f"w{i}" for i in range(60)]:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<bos>", eos_token="<eos>")
    builders = {"gpt2": lambda: tiny_gpt2(n_positions=n_positions),
                "gemma3": lambda: tiny_gemma3(window=8, max_positions=n_positions),
                "llama": tiny_llama,
                "jetmoe": lambda: tiny_jetmoe(max_positions=n_positions)}
    model = builders[kind]()
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


def bridged_tiny_model(folder, kind: str, dtype: torch.dtype = torch.float64) -> tuple:
    """``(hf, bridge, tokenizer)``: a tiny model of ``kind`` (:func:`save_tiny_model_with_tokenizer`) under eager
    attention, and a TransformerLens 4 bridge booted around a copy of it (boot_transformers changes the model
    it is given in place)."""
    import copy

    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_tiny_model_with_tokenizer(folder, kind=kind)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    bridge = TransformerBridge.boot_transformers(path, hf_model=copy.deepcopy(hf), tokenizer=tokenizer, dtype=dtype)
    return hf, bridge, tokenizer


def run_suite_in_environment(venv: str, folder: str, setup: str, *, required_in_ci: bool = True,
                             timeout: int = 1200, env: dict | None = None, installed: bool = False) -> str:
    """Run ``tests/{folder}`` with the Python of the side environment ``.{venv}`` (built by ``scripts/{setup}``);
    skip (fail under CI when ``required_in_ci``) where it was not built. Returns pytest's output; fails unless
    every test passed. ``installed``: the package is the one installed there, never the source tree in the
    working folder (``python -P`` keeps the working folder off ``sys.path``, and ``PYTHONPATH`` is dropped)."""
    import os
    import subprocess
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[1]
    python = root / f".{venv}" / "bin" / "python"
    if not python.exists():
        if required_in_ci and os.environ.get("CI"):
            pytest.fail(f"CI must build .{venv}: run scripts/{setup}")
        pytest.skip(f"no .{venv}: run scripts/{setup} to run tests/{folder} in it")
    if installed:
        env = {key: value for key, value in (os.environ if env is None else env).items() if key != "PYTHONPATH"}
    command = [str(python), *(["-P"] if installed else []), "-m", "pytest", "-q", "-p", "no:cacheprovider",
               str(root / "tests" / folder)]
    completed = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)
    print(completed.stdout[-5000:])
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-3000:]
    assert " passed" in completed.stdout
    return completed.stdout


def write_text_corpus(folder, n_docs: int = 4, words: int = 80) -> str:
    """Plain-text documents, one per file, from the tiny tokenizer's vocabulary."""
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS + [f"w{j}" for j in range(60)]) for _ in range(words))
        (folder / f"doc{i}.txt").write_text(text)
    return str(folder)


def result_header(path) -> dict:
    """The JSON header of a result file (format 3), read as a user would: safetensors and json alone."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="np") as handle:
        return json.loads(handle.metadata()["equivariance_probe"])


def edited_result_file(path, out, edit, *, resign: bool = True, tensors_edit=None):
    """A copy of the result file ``path`` at ``out`` whose header was changed by ``edit(header)`` (and
    tensors by ``tensors_edit(tensors)``). With ``resign``, its header checksum is recomputed, as a
    careful forger would, so that the field checks (not the header checksum) speak."""
    import json

    from safetensors.numpy import load_file, save_file

    from equivariance_probe.records.container import header_checksum

    header = result_header(path)
    tensors = load_file(str(path))
    edit(header)
    if tensors_edit is not None:
        tensors_edit(tensors)
    if resign:
        header["header_checksum"] = header_checksum(header)
    save_file(tensors, str(out), metadata={"equivariance_probe": json.dumps(header)})
    return out

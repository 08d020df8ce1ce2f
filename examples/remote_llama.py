"""How much does a large model's attention depend on absolute position? Run it on NDIF.

The same code runs a 70B model remotely and a tiny model here::

    # on NDIF (needs an API key from https://login.ndif.us and network access)
    export NDIF_API_KEY=...
    python examples/remote_llama.py --remote meta-llama/Llama-3.1-70B --docs 64 --batch-size 8

    # here, offline: a small random Llama with grouped-query attention
    python examples/remote_llama.py

    # on your own NDIF server (pip install ndif; see docs/guide/remote.md):
    # a model folder deployed there with `ndif deploy -f spec.yaml`
    python examples/remote_llama.py --remote /path/to/folder --host http://127.0.0.1:8001 --context 256

Remotely, the per-batch reduction runs inside the nnsight trace on the server, and only
float64 sums come back (about 208 MiB per batch for the 70B model at context 1024,
whatever the batch size, instead of 10 GiB of bf16 patterns per document). The
pattern is recomputed from the queries and keys the server's attention receives, so
the server may run any attention kernel. If the connection drops, the batches that
completed are in ``probe.last_result`` and can be merged with a later run.
"""

from __future__ import annotations

import argparse
import random

import torch

from equivariance_probe import EquivarianceProbe
from equivariance_probe.adapters.nnsight import NNsightAdapter


def remote_model(hub_id: str):
    """An nnsight model named by its hub id (or, for a self-hosted server, the folder the server
    loads): its config is read, no weights are loaded."""
    from nnsight import TransformersModel

    return TransformersModel(hub_id, task="text-generation")


def local_model(seed: int = 0):
    """A small random Llama (grouped-query attention) wrapped in nnsight, built offline."""
    import nnsight
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="eager")
    return nnsight.NNsight(LlamaForCausalLM(config).eval())


def documents(n_docs: int, length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Token windows. Offline there is no tokenizer or corpus, so these are random ids;
    with a real model pass a list of strings instead (tokenised with its tokenizer)."""
    generator = random.Random(seed)
    return torch.tensor([[generator.randrange(vocab_size) for _ in range(length)] for _ in range(n_docs)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--remote", metavar="HUB_ID", default=None,
                        help="run this hub model on NDIF (e.g. meta-llama/Llama-3.1-70B); default: a tiny local model")
    parser.add_argument("--host", default=None,
                        help="a self-hosted NDIF server's URL (default: nnsight's CONFIG.API.HOST, NDIF's public service)")
    parser.add_argument("--docs", type=int, default=16, help="number of documents (windows)")
    parser.add_argument("--context", type=int, default=None, help="tokens per window (default: 1024 remote, 128 local)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per trace (= per remote job)")
    parser.add_argument("--pattern-source", choices=("auto", "weights", "recompute"), default="auto")
    # dest is not "save": nnsight mounts a .save() method on every object, so argparse would find
    # args.save already there and never set its default.
    parser.add_argument("--save", dest="save_to", default=None, help="write the result to this file")
    args = parser.parse_args()

    if args.remote:
        model, remote, context = remote_model(args.remote), args.host or True, args.context or 1024
    else:
        model, remote, context = local_model(), False, args.context or 128
    adapter = NNsightAdapter(model, remote=remote, pattern_source=args.pattern_source)
    probe = EquivarianceProbe(adapter)
    print(probe, "remote" if remote else "local", f"pattern from {adapter.source.resolved()}")

    docs = documents(args.docs, context, adapter.vocab_size or 512)
    try:
        result = probe.run(docs, context_length=context, batch_size=args.batch_size, exclude_keys=[0])
    except KeyboardInterrupt:
        result = probe.last_result
        print(f"interrupted: keeping the {result.statistics.n_windows} windows of complete batches")
    print(result)
    if args.save_to:
        result.save(args.save_to)
        print("saved to", args.save_to)


if __name__ == "__main__":
    main()

"""The remote round trip on a local NDIF server, against the local run of the same model.

    .venv-ndif/bin/python benchmarks/remote.py [--docs 8] [--context 64 256] [--model gemma|llama]

Starts the stack of ``tests/ndif/ndif_stack.py`` (Redis, Ray head with ndif's controller, the API,
ndif's sandboxed model actor on the CPU), deploys a small random model saved to a folder, and runs
the probe with ``batch_size=1`` (one request per window), remotely and locally. Prints per window:
wall time, bytes POSTed (the serialised, zstd-compressed trace: code, functions shipped by value,
tokens) and bytes received (the compressed ``torch.save`` of the float64 sums), and the local time.
With ``--shift`` it runs the shift test instead (``--docs`` segments of 32 tokens, 2 contexts, offsets 0 to the
longest context minus the segment), one request per segment: per segment, the remote and local wall time, the
bytes POSTed and received, and the float64 sums the reply carries.
Needs ``scripts/setup_ndif_env.sh``. Every process it starts is stopped by its id at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "ndif"), str(ROOT / "tests"), str(ROOT)]


def build(name: str, max_positions: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gemma":  # sliding window 32 on 4 of 6 layers, like Gemma 3's 5:1 interleaving in small
        config = Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                                  max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2, layer_types=["sliding_attention"] * 2 + ["full_attention"]
                                  + ["sliding_attention"] * 2 + ["full_attention"])
        return Gemma3ForCausalLM(config).eval()
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--context", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--model", choices=("gemma", "llama"), default="gemma")
    parser.add_argument("--shift", action="store_true", help="the shift test, one request per segment")
    args = parser.parse_args()

    import nnsight
    from conftest import client_model, save_model, token_windows
    from ndif_stack import API_KEY, new_stack
    from nnsight.intervention.backends.remote import RemoteBackend
    from transformers import AutoModelForCausalLM

    from equivariance_probe import EquivarianceProbe
    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.adapters.nnsight_remote import reply_nbytes

    traffic: dict[str, list[int]] = {"sent": [], "received": []}
    post, finalize = RemoteBackend._post, RemoteBackend.finalize
    RemoteBackend._post = lambda self, request, blob: (traffic["sent"].append(len(blob)), post(self, request, blob))[1]
    RemoteBackend.finalize = lambda self, content: (traffic["received"].append(len(content)), finalize(self, content))[1]

    folder = save_model(build(args.model, max(args.context)), Path(tempfile.mkdtemp(prefix="ndif-model")) / args.model)
    stack = new_stack()
    rows = []
    try:
        started = time.perf_counter()
        stack.start()
        up = time.perf_counter() - started
        stack.deploy(client_model(folder).to_model_key(), folder)
        deployed = time.perf_counter() - started - up
        nnsight.CONFIG.API.HOST, nnsight.CONFIG.API.APIKEY = stack.url, API_KEY
        nnsight.CONFIG.APP.REMOTE_LOGGING = False
        hf_model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        layout = NNsightAdapter(client_model(folder), remote=True).layout
        for context in args.context if not args.shift else ():
            tokens = token_windows(args.docs + 1, context)
            remote_probe = EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True))
            remote_probe.run(tokens[:1], batch_size=1, progress=False)  # warm: the first request spawns a runner
            local_probe = EquivarianceProbe(hf_model)
            local_probe.run(tokens[:1], batch_size=1, progress=False)
            for key in traffic:
                traffic[key].clear()
            t0 = time.perf_counter()
            remote_probe.run(tokens[1:], batch_size=1, progress=False)
            remote_s = (time.perf_counter() - t0) / args.docs
            t0 = time.perf_counter()
            local_probe.run(tokens[1:], batch_size=1, progress=False)
            local_s = (time.perf_counter() - t0) / args.docs
            rows.append({
                "context": context, "remote_s_per_window": round(remote_s, 3), "local_s_per_window": round(local_s, 4),
                "sent_bytes_per_window": int(statistics.mean(traffic["sent"])),
                "received_bytes_per_window": int(statistics.mean(traffic["received"])),
                "float64_sums_bytes": reply_nbytes(layout.n_layers, layout.n_heads, context),
            })
        if args.shift:
            rows = [shift_row(folder, hf_model, args.docs, context, traffic) for context in args.context]
    finally:
        stack.stop()
    print(json.dumps({"model": args.model, "stack_start_s": round(up, 1), "deploy_s": round(deployed, 1),
                      "windows": args.docs, "rows": rows}, indent=1))


def shift_row(folder: str, hf_model, n_segments: int, context: int, traffic: dict[str, list[int]]) -> dict:
    """The shift test on ``n_segments`` segments of 32 tokens after 2 contexts, offsets from 0 to ``context − 32``
    (windows up to ``context`` tokens), remotely (one request per segment) and locally."""
    from conftest import client_model

    from equivariance_probe import EquivarianceProbe
    from equivariance_probe.adapters.nnsight import NNsightAdapter
    from equivariance_probe.adapters.nnsight_remote import segment_reply_nbytes

    m, largest = 32, context - 32
    offsets = sorted({round(k * largest / 5) for k in range(6)})
    generator = torch.Generator().manual_seed(0)
    segments = [torch.randint(3, 97, (m,), generator=generator).tolist() for _ in range(n_segments + 1)]
    contexts = [torch.randint(3, 97, (largest,), generator=generator).tolist() for _ in range(2)]
    options = dict(offsets=offsets, segment_length=m, batch_size=len(offsets), progress=False)
    remote_probe = EquivarianceProbe(NNsightAdapter(client_model(folder), remote=True))
    local_probe = EquivarianceProbe(hf_model)
    remote_probe.shift(segments[:1], contexts, **options)  # warm: the first request spawns a runner
    local_probe.shift(segments[:1], contexts, **options)
    for key in traffic:
        traffic[key].clear()
    t0 = time.perf_counter()
    remote_probe.shift(segments[1:], contexts, **options)
    remote_s = (time.perf_counter() - t0) / n_segments
    t0 = time.perf_counter()
    local_probe.shift(segments[1:], contexts, **options)
    local_s = (time.perf_counter() - t0) / n_segments
    layout = remote_probe.adapter.layout
    segment_requests = traffic["received"][1:]  # the first request of a run is its check of the recomputation
    return {"longest_window": context, "offsets": offsets, "windows_per_segment": 2 * len(offsets),
            "remote_s_per_segment": round(remote_s, 3), "local_s_per_segment": round(local_s, 3),
            "sent_bytes_per_segment": int(statistics.mean(traffic["sent"][1:])),
            "received_bytes_per_segment": int(statistics.mean(segment_requests)),
            "float64_sums_bytes": segment_reply_nbytes(layout.n_layers, layout.n_heads, len(offsets),
                                                       hidden_size=hf_model.config.hidden_size)}


if __name__ == "__main__":
    main()

"""NDIF's sandboxed model actor, loading its model on the CPU.

NDIF's model actors (``ndif.services.ray.deployments.modeling.base``) place weights on the GPUs
the controller assigned and call ``torch.cuda`` around every load and request. On a machine
without a GPU the node declares one to Ray (``ray start --num-gpus 1``, so the controller, which
manages GPU nodes only, places models on it), and this actor, deployed through ndif's own
``actor_class`` option, overrides only what touches CUDA: the load (``device_map="cpu"``), the
per-request memory reset, and the HOT/WARM cache moves (it is not cacheable). Everything
else is ndif's: the request template (timeout race, responses, inline or object-store
result), the runner pool, the sandbox driver and the runner process.
"""

from __future__ import annotations

import gc

import ray
from ndif.services.ray.sandbox.model import SandboxModelDeployment
from nnsight.modeling.huggingface import HuggingFaceModel


class CPUSandboxModelDeployment(SandboxModelDeployment):
    CACHEABLE = False

    def load_from_disk(self) -> HuggingFaceModel:
        model = HuggingFaceModel.from_model_key(
            self.model_key, dispatch=True, dtype=self.dtype_name, device_map="cpu", **self.kwargs
        )
        model._module.requires_grad_(False)
        return model

    def cleanup(self) -> None:
        # SandboxHost.cleanup without BaseModelDeployment's torch.cuda.synchronize/empty_cache.
        self.discard_sandbox()
        self.kill_switch.clear()
        self.kill_reason = None
        self.execution_ident = None
        self.model.interleaver.cancel()
        gc.collect()


@ray.remote(num_cpus=1, max_restarts=0)
class CPUSandboxModelActor(CPUSandboxModelDeployment):
    """Ray actor: a CPU model, user code in ndif's sandbox runner process."""

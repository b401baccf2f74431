"""Shared helpers of the deployment tests: built binaries (paths from CTest's environment),
free loopback ports, and a wpubd child process that reports its bound ports."""

import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEPLOY = os.path.join(REPO, "deploy")
sys.path.insert(0, os.path.join(REPO, "clients", "python"))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))

import harness  # noqa: E402  (the one wpubd child-process helper)
from harness import binary, free_port  # noqa: E402,F401  (re-exported for the deployment tests)


class Daemon(harness.Daemon):
    """wpubd for the deployment tests: info-level log (tests read its warnings), 30 s to start."""

    def __init__(self, workdir: str, *flags: str, listen: str = "127.0.0.1:0",
                 metrics: str = "", timeout: float = 30.0):
        super().__init__(workdir, *flags, listen=listen, metrics=metrics, timeout=timeout,
                         log_level="info", commit_deadline="")


def tiny_batches(seed: int = 0):
    """One small bf16 norm weight and one routed-expert gate/up/down set: enough for a real
    publication through the CPU path (quantized and passed-through tensors)."""
    import numpy as np
    import wpub
    rng = np.random.default_rng(seed)

    def bf16(shape):
        x = (rng.standard_normal(shape, dtype=np.float32) * 0.05).view(np.uint32)
        return wpub.Tensor(((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16),
                           dtype="bfloat16")

    h = "model.layers.0"
    return [("decoder.layers.0.input_layernorm.weight",
             [(f"{h}.input_layernorm.weight", bf16((64,)))]),
            ("decoder.layers.0.mlp.experts.linear_fc1.weight0",
             [(f"{h}.mlp.experts.0.gate_proj.weight", bf16((32, 64))),
              (f"{h}.mlp.experts.0.up_proj.weight", bf16((32, 64)))]),
            ("decoder.layers.0.mlp.experts.linear_fc2.weight0",
             [(f"{h}.mlp.experts.0.down_proj.weight", bf16((64, 32)))])]

"""Shared helpers of the deployment tests: built binaries (paths from CTest's environment),
free loopback ports, and a wpubd child process that reports its bound ports."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import unittest

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEPLOY = os.path.join(REPO, "deploy")
sys.path.insert(0, os.path.join(REPO, "clients", "python"))


def binary(var: str) -> str:
    path = os.environ.get(var, "")
    if not path or not os.path.exists(path):
        raise unittest.SkipTest(f"{var} is not set to a built binary (run through ctest)")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """wpubd as a child process; waits for its --ready_file. `stop()` sends SIGTERM and returns
    the exit code."""

    def __init__(self, workdir: str, *flags: str, listen: str = "127.0.0.1:0",
                 metrics: str = "", timeout: float = 30.0):
        self.workdir = workdir
        ready = os.path.join(workdir, f"wpubd-{time.monotonic_ns()}.ready.json")
        args = [binary("WPUBD"), f"--listen={listen}", f"--metrics_listen={metrics}",
                f"--ready_file={ready}", "--log_level=info", *flags]
        self.log_path = os.path.join(workdir, f"wpubd-{time.monotonic_ns()}.log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"wpubd exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"wpubd did not become ready: {self.log()}")
            time.sleep(0.02)
        with open(ready) as f:
            info = json.load(f)
        self.port = info["grpc_port"]
        self.metrics_port = info["metrics_port"]
        self.target = listen if listen.startswith("unix:") else f"127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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

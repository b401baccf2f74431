"""Shared harness of the Python client tests: starts a real wpubd and real wpub-recv processes
(binaries from the env vars WPUBD / WPUB_RECV set by CTest), reads the receivers' safetensors,
builds small Qwen3-MoE-shaped conversion batches and runs the NVFP4 reference tool."""

import itertools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "clients", "python"))
import wpub  # noqa: E402


def binary(var: str) -> str:
    path = os.environ.get(var, "")
    if not path or not os.path.exists(path):
        raise unittest.SkipTest(f"{var} is not set to a built binary (run through ctest)")
    return path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bf16_cuda(a: np.ndarray, device: int = 0):
    """A uint16 bf16 array as a torch bfloat16 tensor of its own on `device` (GPU 0: the
    trainer's and wpubd's). Needs torch (the GPU tests)."""
    import torch
    return torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16).to(f"cuda:{device}")


_HOST_IDS = itertools.count()


def engine_gpu() -> int:
    """The GPU the engine ranks of a GPU test use: WPUB_TEST_ENGINE_GPU when set, else GPU 1 when
    torch sees two, else GPU 0 -- shared with wpubd's rank (see nccl_env). wpubd and the
    trainer's tensors are on GPU 0."""
    forced = os.environ.get("WPUB_TEST_ENGINE_GPU", "")
    if forced:
        return int(forced)
    import torch  # the GPU tests have it; the CPU tests never call this
    return 1 if torch.cuda.device_count() >= 2 else 0


def nccl_env(shared: bool, base=None) -> dict:
    """The environment of a process that joins an NCCL group (wpubd, an engine, wpub-recv): a
    copy of `base` (os.environ) that, when `shared` (its rank shares a GPU with another rank),
    gives it a host identity of its own and NCCL's loopback socket settings. NCCL (2.28)
    refuses two ranks on one device only when they report the same host, and reads the host
    from NCCL_HOSTID once per process; the ranks then talk over NCCL's socket transport (the
    real protocol and bytes, a socket's speed). Not shared: `base` as it is."""
    env = dict(os.environ if base is None else base)
    if shared:
        env.update(NCCL_HOSTID=f"wpub-test-{os.getpid()}-{next(_HOST_IDS)}-{time.monotonic_ns()}",
                   NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    return env


class ChildProcess:
    """A child process whose stdout and stderr go to `log_path` (in `env`, default this
    process's environment); `stop()` sends SIGTERM, kills it after `stop_grace` seconds, and
    returns its exit code."""

    stop_grace = 20.0
    log_tail = 4000

    def _start(self, args, log_path: str, env=None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-self.log_tail:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Daemon(ChildProcess):
    """A wpubd child process; waits for its --ready_file and records the bound ports (`port`,
    `metrics_port`, `target`). `stop()` sends SIGTERM and returns the exit code. `env`: its
    environment (nccl_env for a GPU-path daemon whose rank shares a GPU). Shared by the Python
    client tests and the deployment tests."""

    stop_grace = 30.0
    log_tail = 6000

    def __init__(self, workdir: str, *flags: str, token: str = "", listen: str = "127.0.0.1:0",
                 metrics: str = "", timeout: float = 20.0, log_level: str = "warn",
                 commit_deadline: str = "30s", env=None):
        self.workdir = workdir
        ready = os.path.join(workdir, f"wpubd-{time.monotonic_ns()}.ready.json")
        args = [binary("WPUBD"), f"--listen={listen}", f"--metrics_listen={metrics}",
                f"--ready_file={ready}", f"--log_level={log_level}", *flags]
        if commit_deadline:
            args.insert(1, f"--commit_deadline={commit_deadline}")  # before flags: they override
        if token:
            tf = os.path.join(workdir, "token")
            with open(tf, "w") as f:
                f.write(token)
            args.append(f"--auth_token_file={tf}")
        self._start(args, os.path.join(workdir, f"wpubd-{time.monotonic_ns()}.log"), env)
        deadline = time.monotonic() + timeout
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"wpubd exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                self._log.close()
                raise RuntimeError(f"wpubd did not become ready: {self.log()}")
            time.sleep(0.02)
        time.sleep(0.05)  # the ready file is written in one go, but be safe with partial reads
        with open(ready) as f:
            info = json.load(f)
        self.port = info["grpc_port"]
        self.metrics_port = info.get("metrics_port", 0)
        self.target = listen if listen.startswith("unix:") else f"127.0.0.1:{self.port}"


class Receiver(ChildProcess):
    """A wpub-recv child process writing every committed version to `output`."""

    def __init__(self, daemon: Daemon, name: str, *flags: str):
        self.output = os.path.join(daemon.workdir, f"{name}.safetensors")
        self._start([binary("WPUB_RECV"), f"--target={daemon.target}", f"--name={name}",
                     f"--output={self.output}", "--log_level=warn", *flags],
                    os.path.join(daemon.workdir, f"{name}.log"))


def wait_for_receivers(pub: "wpub.Publisher", n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(pub.status().receivers) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} receivers did not subscribe within {timeout} s")
        time.sleep(0.05)


def wait_idle(pub: "wpub.Publisher", timeout: float = 20.0) -> "wpub.Status":
    """Waits until the daemon has no active publication (an aborted one is torn down
    asynchronously after the client's RPC ended)."""
    deadline = time.monotonic() + timeout
    while True:
        s = pub.status(max_reports=8)
        if s.active is None:
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(f"publication v{s.active.version} still active after {timeout} s")
        time.sleep(0.05)


_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "U8": "uint8",
              "F8_E4M3": "float8_e4m3fn", "I8": "int8", "I32": "int32", "I64": "int64",
              "F64": "float64", "BOOL": "bool"}
_TORCH_TO_ST = {v: k for k, v in _ST_DTYPES.items()}


def read_safetensors(path: str):
    """({name: (dtype torch name, shape tuple, bytes)}, metadata)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        out[name] = (_ST_DTYPES[e["dtype"]], tuple(e["shape"]), data[base + b:base + end])
    return out, meta


def write_safetensors(path: str, tensors) -> None:
    """tensors: {name: (torch dtype name, shape, bytes)}."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": _TORCH_TO_ST[dtype], "shape": list(shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def bf16(rng: np.random.Generator, shape, scale: float = 0.05) -> np.ndarray:
    """Random bf16 values as uint16 (the top half of float32, rounded to nearest even)."""
    x = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
    x = x + 0x7FFF + ((x >> 16) & 1)
    return (x >> 16).astype(np.uint16)


def qwen3_batches(seed: int, layers=(0,), experts: int = 4, hidden: int = 64, inter: int = 32,
                  heads: int = 2, kv_heads: int = 1, head_dim: int = 32):
    """A small Qwen3-MoE-shaped model as (megatron_name, [(hf_name, uint16 bf16 array)])
    conversion batches: attention, norms, router and per-expert gate/up (one Megatron fc1 per
    expert) and down projections."""
    rng = np.random.default_rng(seed)
    out = []
    for L in layers:
        m, h = f"decoder.layers.{L}", f"model.layers.{L}"
        out.append((f"{m}.self_attention.linear_qkv.weight", [
            (f"{h}.self_attn.q_proj.weight", bf16(rng, (heads * head_dim, hidden))),
            (f"{h}.self_attn.k_proj.weight", bf16(rng, (kv_heads * head_dim, hidden))),
            (f"{h}.self_attn.v_proj.weight", bf16(rng, (kv_heads * head_dim, hidden)))]))
        out.append((f"{m}.self_attention.linear_proj.weight",
                    [(f"{h}.self_attn.o_proj.weight", bf16(rng, (hidden, heads * head_dim)))]))
        out.append((f"{m}.self_attention.q_layernorm.weight",
                    [(f"{h}.self_attn.q_norm.weight", bf16(rng, (head_dim,)))]))
        out.append((f"{m}.input_layernorm.weight",
                    [(f"{h}.input_layernorm.weight", bf16(rng, (hidden,)))]))
        out.append((f"{m}.mlp.router.weight",
                    [(f"{h}.mlp.gate.weight", bf16(rng, (experts, hidden)))]))
        routed_experts(out, rng, m, h, experts, hidden, inter)
    return out


def routed_experts(out, rng, m: str, h: str, experts: int, hidden: int, inter: int) -> None:
    """Appends one MoE layer's routed experts: per expert a Megatron fc1 (HF gate/up, one
    batch, so they share an amax) and an fc2 (HF down)."""
    for e in range(experts):
        out.append((f"{m}.mlp.experts.linear_fc1.weight{e}", [
            (f"{h}.mlp.experts.{e}.gate_proj.weight", bf16(rng, (inter, hidden))),
            (f"{h}.mlp.experts.{e}.up_proj.weight", bf16(rng, (inter, hidden)))]))
        out.append((f"{m}.mlp.experts.linear_fc2.weight{e}",
                    [(f"{h}.mlp.experts.{e}.down_proj.weight", bf16(rng, (hidden, inter)))]))


def as_wire(batches):
    """The batches with every uint16 array wrapped as an explicit bfloat16 wpub.Tensor."""
    return [(m, [(n, wpub.Tensor(a, dtype="bfloat16")) for n, a in ts]) for m, ts in batches]


def reference(workdir: str, batches, recipe: str = "nvfp4"):
    """Expected receiver contents for `batches` under the default policy: routed-expert
    weights quantized by wpub-quantize-ref (gate/up of one expert share an amax), everything
    else passed through byte for byte. {name: (dtype, shape, bytes)}."""
    inputs, groups, expected = {}, [], {}
    for _, ts in batches:
        names = []
        for name, arr in ts:
            if ".mlp.experts." in name:
                inputs[name] = ("bfloat16", arr.shape, arr.tobytes())
                names.append(name)
            else:
                expected[name] = ("bfloat16", tuple(arr.shape), arr.tobytes())
        if names:
            groups.append(",".join(names))
    if groups:
        src = os.path.join(workdir, "ref-in.safetensors")
        dst = os.path.join(workdir, "ref-out.safetensors")
        write_safetensors(src, inputs)
        subprocess.run([binary("WPUB_QUANTIZE_REF"), f"--input={src}", f"--output={dst}",
                        f"--recipe={recipe}", f"--groups={';'.join(groups)}"], check=True)
        expected.update(read_safetensors(dst)[0])
    return expected


class DaemonTestCase(unittest.TestCase):
    """One wpubd and `RECEIVERS` wpub-recv processes per test class."""

    RECEIVERS = 1
    DAEMON_FLAGS = ()
    RECEIVER_FLAGS = ()

    @classmethod
    def setUpClass(cls):
        cls.workdir = tempfile.mkdtemp(prefix=f"wpub-py-{cls.__name__}-")
        cls.daemon = Daemon(cls.workdir, f"--min_receivers={cls.RECEIVERS}", *cls.DAEMON_FLAGS)
        cls.receivers = [Receiver(cls.daemon, f"recv-{i}", *cls.RECEIVER_FLAGS)
                         for i in range(cls.RECEIVERS)]
        cls.pub = wpub.Publisher(cls.daemon.target, timeout=60)
        cls.pub.wait_ready()
        wait_for_receivers(cls.pub, cls.RECEIVERS)
        cls.version = 0

    @classmethod
    def tearDownClass(cls):
        cls.pub.close()
        codes = [r.stop() for r in cls.receivers]
        code = cls.daemon.stop()
        keep = os.environ.get("WPUB_TEST_KEEP")
        if not keep:
            shutil.rmtree(cls.workdir, ignore_errors=True)
        assert code == 0, f"wpubd exited with {code}"
        assert all(c == 0 for c in codes), f"wpub-recv exit codes {codes}"

    def next_version(self) -> int:
        cls = type(self)
        cls.version = max(cls.version, self.pub.status().committed_version) + 1
        return cls.version

    def received(self, index: int = 0, version: int = 0, timeout: float = 20.0):
        """The receiver's file, once it holds `version` (receivers apply a commit after the
        daemon answered Publish, so the file may lag the report briefly)."""
        path = self.receivers[index].output
        deadline = time.monotonic() + timeout
        while True:
            if os.path.exists(path):
                got, meta = read_safetensors(path)
                if not version or meta.get("version") == str(version):
                    return got, meta
            if time.monotonic() > deadline:
                self.fail(f"receiver {index} did not write v{version} within {timeout} s")
            time.sleep(0.05)

    def assertReceivedEqual(self, expected, version: int, index: int = 0):
        got, meta = self.received(index, version)
        # transformers refuses a safetensors file whose metadata lacks format "pt".
        self.assertEqual(meta.get("format"), "pt")
        self.assertEqual(sorted(got), sorted(expected))
        for name, (dtype, shape, raw) in expected.items():
            gd, gs, gr = got[name]
            self.assertEqual((gd, tuple(gs)), (dtype, tuple(shape)), name)
            self.assertTrue(gr == raw, f"{name}: received bytes differ from the reference")


def glm_batches(seed: int, hidden: int = 64, inter: int = 32, experts: int = 4,
                heads: int = 2, head_dim: int = 32, moe_layers=(1, 2), mtp_layer: int = 3):
    """A small GLM-like MoE as conversion batches: embeddings, a dense first layer, MoE layers
    with a shared expert and routed experts, the final norm and head, and an MTP layer (its own
    norms, eh_proj and a MoE block)."""
    rng = np.random.default_rng(seed)
    out = [("embedding.word_embeddings.weight",
            [("model.embed_tokens.weight", bf16(rng, (128, hidden)))])]

    def attention(m, h):
        out.append((f"{m}.self_attention.linear_qkv.weight", [
            (f"{h}.self_attn.q_proj.weight", bf16(rng, (heads * head_dim, hidden))),
            (f"{h}.self_attn.k_proj.weight", bf16(rng, (head_dim, hidden))),
            (f"{h}.self_attn.v_proj.weight", bf16(rng, (head_dim, hidden)))]))
        out.append((f"{m}.self_attention.linear_proj.weight",
                    [(f"{h}.self_attn.o_proj.weight", bf16(rng, (hidden, heads * head_dim)))]))
        out.append((f"{m}.input_layernorm.weight",
                    [(f"{h}.input_layernorm.weight", bf16(rng, (hidden,)))]))

    def moe(m, h):
        out.append((f"{m}.mlp.router.weight",
                    [(f"{h}.mlp.gate.weight", bf16(rng, (experts, hidden)))]))
        out.append((f"{m}.mlp.shared_experts.linear_fc1.weight", [
            (f"{h}.mlp.shared_experts.gate_proj.weight", bf16(rng, (inter, hidden))),
            (f"{h}.mlp.shared_experts.up_proj.weight", bf16(rng, (inter, hidden)))]))
        out.append((f"{m}.mlp.shared_experts.linear_fc2.weight",
                    [(f"{h}.mlp.shared_experts.down_proj.weight", bf16(rng, (hidden, inter)))]))
        routed_experts(out, rng, m, h, experts, hidden, inter)

    attention("decoder.layers.0", "model.layers.0")
    out.append(("decoder.layers.0.mlp.linear_fc1.weight", [
        ("model.layers.0.mlp.gate_proj.weight", bf16(rng, (2 * inter, hidden))),
        ("model.layers.0.mlp.up_proj.weight", bf16(rng, (2 * inter, hidden)))]))
    out.append(("decoder.layers.0.mlp.linear_fc2.weight",
                [("model.layers.0.mlp.down_proj.weight", bf16(rng, (hidden, 2 * inter)))]))
    for L in moe_layers:
        attention(f"decoder.layers.{L}", f"model.layers.{L}")
        moe(f"decoder.layers.{L}", f"model.layers.{L}")
    out.append(("decoder.final_layernorm.weight", [("model.norm.weight", bf16(rng, (hidden,)))]))
    out.append(("output_layer.weight", [("lm_head.weight", bf16(rng, (128, hidden)))]))
    m, h = "mtp.layers.0", f"model.layers.{mtp_layer}"
    out.append((f"{m}.enorm.weight", [(f"{h}.enorm.weight", bf16(rng, (hidden,)))]))
    out.append((f"{m}.hnorm.weight", [(f"{h}.hnorm.weight", bf16(rng, (hidden,)))]))
    out.append((f"{m}.eh_proj.weight", [(f"{h}.eh_proj.weight", bf16(rng, (hidden, 2 * hidden)))]))
    moe(f"{m}.transformer_layer", h)
    return out


def http_json(url: str, timeout: float = 10.0):
    """GET `url` and parse its JSON answer (the engine emulators' /health and /stats)."""
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def wait_http(url: str, timeout: float = 30.0) -> None:
    """Polls `url` until it answers 200, whatever the body (an emulator or engine coming up:
    wpub-recv's /health has no JSON body)."""
    import urllib.request
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

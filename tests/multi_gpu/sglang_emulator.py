#!/usr/bin/env python3
"""An SGLang engine stand-in for wpub's multi-GPU tests and benchmark.

It serves SGLang's weight-update HTTP routes with Python's http.server and builds its
weight-update group exactly as SGLang does (torch.distributed `rendezvous` + `PrefixStore(group
name)` + `_new_process_group_helper`, backend nccl), so wpubd's TCPStore server, unique-id key and
NCCL broadcasts are exercised against torch itself. Each `/update_weights_from_distributed` with
`load_format: flattened_bucket` receives ONE uint8 broadcast and decodes every tensor as
`buf[off:off+n].view(dtype).reshape(shape)`. With --expect-dir, every tensor is compared byte for
byte with the expected bucket file `<dir>/v<version>/bucket<index>.bin` (written by the test from
the CPU reference); results are served on GET /stats.

As SGLang does, every bucket is loaded into the live weights the moment it arrives (there is no
staging and no roll back), `/pause_generation` stops serving and `/continue_generation` serves
whatever the live weights hold: `served` in /stats counts each resume with the versions the
weights held then, and `mixed_resumes` counts resumes on a mix of versions (a wpub defect).
`/get_model_info` reports `weight_version` as SGLang does; `/generate` answers with the versions
the live weights hold (HTTP 503 while paused).

Releases (--release, from SGLang's own code: http_server.py, scheduler_components/
weight_updater.py and scheduler.py at 00a2ca2e56d59f0a19186d7a8a58bdda5201023f, tensor_bucket.py
before and after PRs #13413/#13824): 0.5.16 has the weight-update session, and its scheduler's
assertions -- a begin on an open session, an end or a distributed update without one -- kill the
server (the request gets no answer); 0.5.6 has no session (begin/end answer 404); 0.5.5 takes no
flattened bucket (one broadcast per tensor, each in its dtype). Every weight route answers
success=false with HTTP 400.

Colocated engines (`/update_weights_from_tensor`, SGLang's CUDA IPC route), modelled from
SGLang's scheduler_components/weight_updater.py (update_weights_from_tensor: the open-session
assertion, serialized_named_tensors[tp_rank]), utils/common.py (MultiprocessingSerializer.
deserialize: standard base64 with validate=True, then SafeUnpickler -- its module-prefix
allowlist and class denylist at 004f0c7a8d398a9c4b6844c1d8071502fa88e78c; a refused class raises
in the scheduler, which kills the server), utils/patch_torch.py (rebuild_cuda_tensor's device
argument may be a device UUID string, mapped to the local device) at
04643955d5327edea893c1f44c87ed29a861a48c, and weight_sync/tensor_bucket.py (the multi-dtype
FlattenedTensorBucket: tensor i is flattened[start:end].view(dtype).reshape(shape)) at
0cbf0687be1b263c40f5e888741646398cd43809. The tensors are rebuilt by torch's own
rebuild_cuda_tensor (CUDA IPC open, the event wait, the reference-counter decrement when they
are freed), copied into the live weights without a device sync before the answer (as SGLang
answers), and dropped. --tp N decodes the entries of N TP ranks (one process stands for the N
schedulers). POST /check {"version": V} compares every live weight with <expect-dir>/v<V>/
tensors/<name>.bin (test-only).

Test-only extras: GET /health, GET /stats, POST /bench_recv (receive `count` broadcasts of `nbytes`
for the plain-NCCL baseline), --die-at-bucket N (SIGKILL itself when bucket N's request arrives:
a receiver dying mid-publication), --fail-at-bucket N (receive bucket N of the first version
that reaches it, load half of its tensors, then answer success=false: SGLang's "partially
updated" failure); with --fail-version V --fail-count K, bucket N of each of the first K
attempts at version V fails that way instead.
"""
import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import base64
import binascii
import dataclasses
import io
import pickle
import types

import torch
import torch.distributed as dist
import torch.multiprocessing.reductions as reductions

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
ELEMENT_SIZES = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}


def init_custom_process_group(backend, init_method, timeout, world_size, rank, group_name,
                              device_id=None):
    """What SGLang's utils.init_custom_process_group does (torch >= 2.6 argument names)."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world,
                                                    rendezvous)
    backend = Backend(backend)
    rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
    store, rank, world_size = next(rendezvous_iterator)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    kwargs = {"backend_options": None}
    if device_id is not None:
        kwargs["device_id"] = device_id
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store,
                                      group_name=group_name, timeout=timeout, **kwargs)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


# SGLang's FlattenedTensorMetadata, importable under its module path for the unpickler
# (sglang/srt/weight_sync/tensor_bucket.py: a plain dataclass of these six fields).
@dataclasses.dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _install_sglang_modules():
    path = "sglang.srt.weight_sync.tensor_bucket"
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        sys.modules.setdefault(name, types.ModuleType(name))
    FlattenedTensorMetadata.__module__ = path
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    sys.modules[path].FlattenedTensorMetadata = FlattenedTensorMetadata


_install_sglang_modules()

# SGLang's SafeUnpickler (utils/common.py at 004f0c7a): a class loads when it is not denied and
# its module (with a trailing '.') starts with an allowed prefix; anything else raises.
ALLOWED_MODULE_PREFIXES = (
    "builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.", "types.",
    "weakref.", "torch.", "torch._tensor.", "torch.storage.", "torch.nn.parameter.",
    "torch.autograd.function.", "torch.distributed.", "torch.distributed._shard.",
    "torch.distributed._composable.", "torch._C._distributed_c10d.",
    "torch._C._distributed_fsdp.", "torch.distributed.optim.", "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.", "pickletools.", "peft.", "transformers.", "huggingface_hub.",
    "sglang.srt.weight_sync.tensor_bucket.", "sglang.srt.model_executor.model_runner.",
    "sglang.srt.layers.", "sglang.srt.utils.")
DENY_CLASSES = {("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"),
                ("os", "system"), ("subprocess", "Popen"), ("subprocess", "run"),
                ("codecs", "decode"), ("types", "CodeType"), ("types", "FunctionType")}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in DENY_CLASSES or not any(
                (module + ".").startswith(p) for p in ALLOWED_MODULE_PREFIXES):
            raise RuntimeError(f"Blocked unsafe class loading ({module}.{name}), to prevent "
                               f"exploitation of CVE-2025-10164")
        return super().find_class(module, name)


def _device_from_maybe_uuid(device):
    """patch_torch.py: an int is the local ordinal; a str is matched against str(uuid)."""
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == device:
                return i
        raise Exception(f"Invalid device_uuid={device}")
    raise Exception(f"Unknown type: device={device}")


def monkey_patch_torch_reductions():
    """What SGLang's monkey_patch_torch_reductions does on the receiving side: the module's
    rebuild_cuda_tensor takes a device UUID at argument 6 (patched once)."""
    if hasattr(reductions, "_rebuild_cuda_tensor_original"):
        return
    reductions._rebuild_cuda_tensor_original = reductions.rebuild_cuda_tensor

    def _rebuild_cuda_tensor_modified(*args):
        t0 = time.perf_counter()
        args = list(args)
        args[6] = _device_from_maybe_uuid(args[6])
        try:
            return reductions._rebuild_cuda_tensor_original(*args)
        finally:
            REBUILD_SECONDS[0] += time.perf_counter() - t0

    reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_modified
    reductions.init_reductions()


# Seconds spent in rebuild_cuda_tensor (the CUDA IPC open), for --timings.
REBUILD_SECONDS = [0.0]


def b64_bytes(data):
    """MultiprocessingSerializer.deserialize's first step: base64 (standard, validate=True) for
    a str; its second is SafeUnpickler(io.BytesIO(data)).load()."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    return data


class Engine:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda", args.gpu)
        torch.cuda.set_device(self.device)
        self.groups = {}
        self.lock = threading.Lock()
        self.stats = {"versions": {}, "weight_version": None, "calls": [], "errors": [],
                      "serving": True, "served": [], "mixed_resumes": 0, "failed_once": False,
                      "session_open": False, "begins": 0, "ends": 0, "failures": 0}
        self.attempt_buckets = 0  # buckets since the last pause (one attempt's)
        self.weights = {}
        self.live_versions = {}  # tensor name -> version of the bytes the live weights hold

    # -- helpers -----------------------------------------------------------------------------
    def record(self, version, **kw):
        v = self.stats["versions"].setdefault(
            str(version), {"buckets": 0, "tensors": 0, "bytes": 0, "mismatches": [],
                           "checked": 0, "recv_seconds": 0.0})
        for k, val in kw.items():
            if isinstance(val, list):
                v[k].extend(val)
            else:
                v[k] += val

    def expected_bucket(self, version, index):
        if not self.args.expect_dir:
            return None
        path = os.path.join(self.args.expect_dir, f"v{version}", f"bucket{index}.bin")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return f.read()

    def expected_tensor(self, version, name):
        """Per-tensor expectations (<dir>/v<version>/tensors/<name>.bin), when no bucket file."""
        if not self.args.expect_dir:
            return None
        path = os.path.join(self.args.expect_dir, f"v{version}", "tensors", name + ".bin")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return f.read()

    # -- routes ------------------------------------------------------------------------------
    def init_group(self, req):
        timeout = __import__("datetime").timedelta(seconds=self.args.nccl_timeout)
        device_id = self.device if self.args.eager_init else None
        pg = init_custom_process_group(
            backend=req.get("backend", "nccl"),
            init_method=f"tcp://{req['master_address']}:{req['master_port']}",
            timeout=timeout, world_size=req["world_size"],
            rank=req["rank_offset"] + 0, group_name=req["group_name"], device_id=device_id)
        self.groups[req["group_name"]] = pg
        return {"success": True, "message": f"joined {req['group_name']} as rank "
                                            f"{req['rank_offset']}"}

    def destroy_group(self, req):
        pg = self.groups.pop(req.get("group_name"), None)
        if pg is not None:
            try:
                dist.destroy_process_group(pg)
            except Exception as e:  # a group broken by an aborted peer may refuse a clean exit
                self.stats["errors"].append(f"destroy: {e}")
        return {"success": True, "message": "destroyed"}

    def update(self, req):
        names, dtypes, shapes = req["names"], req["dtypes"], req["shapes"]
        pg = self.groups[req["group_name"]]
        version = req.get("weight_version")
        index = self.stats.setdefault("bucket_counter", {}).get(str(version), 0)
        self.stats["bucket_counter"][str(version)] = index + 1
        if self.args.die_at_bucket is not None and index == self.args.die_at_bucket:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        # --fail-version V --fail-count K: bucket N of each of the first K attempts at version
        # V fails instead (the attempt's bucket index restarts at every pause).
        attempt_index = self.attempt_buckets
        self.attempt_buckets += 1
        if self.args.fail_version is not None:
            fail_here = (self.args.fail_at_bucket is not None and str(version) ==
                         str(self.args.fail_version) and attempt_index == self.args.fail_at_bucket
                         and self.stats["failures"] < self.args.fail_count)
        else:
            fail_here = (self.args.fail_at_bucket is not None and
                         index == self.args.fail_at_bucket and not self.stats["failed_once"])
        flattened = req.get("load_format") == "flattened_bucket"
        if flattened and self.args.release == "0.5.5":
            # Before PRs #13413/#13824 (tensor_bucket.py): no flattened bucket of mixed dtypes.
            raise ValueError("Failed to update parameter online: load_format flattened_bucket is "
                             "not supported. Please discard the whole weights.")
        if not flattened and self.args.release != "0.5.5":
            raise ValueError("this emulator takes load_format=flattened_bucket from 0.5.6 on")
        sizes = []
        for dt, shp in zip(dtypes, shapes):
            n = 1
            for d in shp:
                n *= d
            sizes.append(n * ELEMENT_SIZES[dt])
        total = sum(sizes)
        t0 = time.perf_counter()
        if flattened:
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, src=0, group=pg)
        else:
            # SGLang's per-tensor receive: one broadcast per tensor, each in its own dtype.
            parts = []
            for dt, shp in zip(dtypes, shapes):
                t = torch.empty(shp, dtype=DTYPES[dt], device=self.device)
                dist.broadcast(t, src=0, group=pg)
                parts.append(t.reshape(-1).view(torch.uint8))
            buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8,
                                                               device=self.device)
        torch.cuda.synchronize(self.device)
        recv = time.perf_counter() - t0
        mismatches = []
        checked = 0
        expected = self.expected_bucket(version, index)
        by_name = expected is None and self.args.expect_dir
        off = 0
        host = buf.cpu() if (expected is not None or by_name) else None
        for k, (name, dt, shp, n) in enumerate(zip(names, dtypes, shapes, sizes)):
            if fail_here and k >= len(names) // 2:
                break  # loaded half of the bucket, then failed
            t = buf[off:off + n].view(DTYPES[dt]).reshape(shp)  # SGLang's decode
            self.live_versions[name] = version  # loaded into the live weights on receipt
            want = expected[off:off + n] if expected is not None else (
                self.expected_tensor(version, name) if by_name else None)
            if by_name and want is None:
                mismatches.append(f"v{version} bucket {index} {name}: no expectation")
            elif want is not None:
                got = host[off:off + n].numpy().tobytes()
                checked += 1
                if len(want) != n:
                    mismatches.append(f"v{version} {name}: {n} bytes, expected {len(want)}")
                    off += n
                    continue
                if got != want:
                    first = next(i for i in range(n) if got[i] != want[i])
                    mismatches.append(f"v{version} bucket {index} {name}: first differing byte "
                                      f"{first} got {got[first]} want {want[first]}")
            if self.args.keep:
                self.weights[name] = t
            off += n
        if expected is not None and len(expected) != total:
            mismatches.append(f"v{version} bucket {index}: {total} bytes received, expected "
                              f"file has {len(expected)}")
        self.record(version, buckets=1, tensors=len(names), bytes=total, checked=checked,
                    mismatches=mismatches, recv_seconds=recv)
        if fail_here:
            self.stats["failed_once"] = True
            self.stats["failures"] += 1
            return {"success": False,
                    "message": "Failed to update weights: partially updated. Please discard the "
                               "whole weights."}
        return {"success": True, "message": f"bucket {index}: {len(names)} tensors"}

    def update_from_tensor(self, req):
        """SGLang's update_weights_from_tensor, per TP rank: deserialize the rank's entry,
        rebuild the flattened bucket, load every tensor into the live weights. With
        WPUB_EMULATOR_PROFILE set, every call runs under cProfile and the accumulated statistics
        (cumulative time, the top 40 entries) are rewritten to that path plus "." and the pid after
        each call."""
        path = os.environ.get("WPUB_EMULATOR_PROFILE")
        if not path:
            return self._update_from_tensor(req)
        import cProfile, pstats
        if not hasattr(self, "_profile"):
            self._profile = cProfile.Profile()
        self._profile.enable()
        try:
            return self._update_from_tensor(req)
        finally:
            self._profile.disable()
            with open(f"{path}.{os.getpid()}", "w") as f:
                pstats.Stats(self._profile, stream=f).sort_stats("cumulative").print_stats(40)

    def _update_from_tensor(self, req):
        index = self.stats.setdefault("tensor_buckets", 0)
        self.stats["tensor_buckets"] = index + 1
        if self.args.die_at_bucket is not None and self.attempt_buckets == self.args.die_at_bucket:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        attempt_index = self.attempt_buckets
        self.attempt_buckets += 1
        entries = req["serialized_named_tensors"]
        load_format = req.get("load_format")
        if load_format != "flattened_bucket":
            self.die(f"NotImplementedError: this emulator models load_format=flattened_bucket "
                     f"only, got {load_format}")
        names = 0
        t0 = time.perf_counter()
        for rank in range(self.args.tp):
            if rank >= len(entries):
                self.die(f"IndexError: serialized_named_tensors has {len(entries)} entries, "
                         f"rank {rank}")
            t_rank = time.perf_counter()
            try:
                monkey_patch_torch_reductions()
                raw = b64_bytes(entries[rank])
                t_b64 = time.perf_counter()
                REBUILD_SECONDS[0] = 0.0
                payload = SafeUnpickler(io.BytesIO(raw)).load()
            except (RuntimeError, pickle.UnpicklingError, binascii.Error, ValueError) as e:
                self.die(f"{type(e).__name__}: {e}")  # raised in the scheduler: the server dies
            flattened = payload["flattened_tensor"]
            metadata = payload["metadata"]
            t_open = time.perf_counter()
            if self.args.tensor_load == "bucket":
                # The cheapest load an engine could do: the whole bucket in one device copy
                # (the benchmark's engine: what the handover itself costs).
                live = self.weights.get((rank, "bucket", attempt_index))
                if live is None or live.numel() != flattened.numel():
                    live = torch.empty_like(flattened, device=self.device)
                    self.weights[(rank, "bucket", attempt_index)] = live
                live.copy_(flattened, non_blocking=True)
                names += len(metadata)
                metadata = []
            for meta in metadata:
                t = flattened[meta.start_idx:meta.end_idx].view(meta.dtype).reshape(meta.shape)
                live = self.weights.get((rank, meta.name))
                if live is None or live.shape != t.shape or live.dtype != t.dtype:
                    live = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                    self.weights[(rank, meta.name)] = live
                live.copy_(t, non_blocking=True)  # no device sync before the answer
                self.live_versions[meta.name] = "pending"
                names += 1
                del t
            t_copy = time.perf_counter()
            del flattened, metadata, payload  # torch's deleter: stream sync, counter decrement
            t_free = time.perf_counter()
            if self.args.timings:
                print(f"bucket {attempt_index} rank {rank}: base64 {t_b64 - t_rank:.4f} s, "
                      f"unpickle {t_open - t_b64 - REBUILD_SECONDS[0]:.4f} s, "
                      f"rebuild {REBUILD_SECONDS[0]:.4f} s, "
                      f"decode+open {t_open - t_rank:.4f} s, "
                      f"load {t_copy - t_open:.4f} s, free {t_free - t_copy:.4f} s", flush=True)
        if (self.args.fail_at_bucket is not None and attempt_index == self.args.fail_at_bucket
                and not self.stats["failed_once"]):
            self.stats["failed_once"] = True
            return {"success": False, "message": "Failed to update weights: partially updated."}
        self.stats.setdefault("tensor_seconds", 0.0)
        self.stats["tensor_seconds"] += time.perf_counter() - t0
        return {"success": True, "message": "Success"}

    def check(self, req):
        """Every live weight (each rank's) against the expected bytes of version V."""
        version = str(req["version"])
        torch.cuda.synchronize(self.device)
        mismatches, checked = [], 0
        for (rank, name), t in sorted(self.weights.items()):
            want = self.expected_tensor(version, name)
            if want is None:
                mismatches.append(f"rank {rank} {name}: no expectation for v{version}")
                continue
            got = t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
            checked += 1
            if got != want:
                mismatches.append(f"rank {rank} {name}: differs from v{version}")
        return {"success": True, "checked": checked, "mismatches": mismatches[:10],
                "weights": len(self.weights)}

    def held_versions(self):
        return sorted({str(v) for v in self.live_versions.values()})

    def pause(self, req):
        self.stats["serving"] = False
        self.attempt_buckets = 0
        return {"success": True, "message": "paused"}

    def resume(self, req):
        held = self.held_versions()
        self.stats["serving"] = True
        self.stats["served"].append(held)
        if len(held) > 1:
            self.stats["mixed_resumes"] += 1
        return {"success": True, "message": "continued"}

    def bench_recv(self, req):
        pg = self.groups[req["group_name"]]
        buf = torch.empty(req["nbytes"], dtype=torch.uint8, device=self.device)
        for _ in range(req["count"]):
            dist.broadcast(buf, src=0, group=pg)
        torch.cuda.synchronize(self.device)
        return {"success": True, "message": "received"}

    # SGLang serves these for POST only; FastAPI answers a GET of them 405 (a route it lacks:
    # 404), which is how wpubd's join probes what a release serves.
    POST_ROUTES = ("/init_weights_update_group", "/destroy_weights_update_group",
                   "/update_weights_from_distributed", "/update_weights_from_tensor",
                   "/update_weight_version",
                   "/pause_generation", "/continue_generation", "/begin_weight_update",
                   "/end_weight_update")

    SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")

    def die(self, why):
        """An assertion in SGLang's scheduler: "Scheduler hit an exception", SIGQUIT to the
        server's process tree; the request gets no answer (scheduler.py at 00a2ca2e)."""
        print(f"Scheduler hit an exception: AssertionError: {why}", flush=True)
        os._exit(1)

    def handle(self, method, path, body):
        session = self.args.release == "0.5.16"
        if path in self.SESSION_ROUTES and not session:
            return 404, {"detail": "Not Found"}  # a release before the weight-update session
        if method == "GET" and path in self.POST_ROUTES:
            return 405, {"detail": "Method Not Allowed"}
        self.stats["calls"].append(path)
        if path == "/health":
            return 200, {"ok": True}
        if path in ("/server_info", "/get_server_info"):
            if path == "/server_info" and not session:
                return 404, {"detail": "Not Found"}
            # A test receiver: it checks every bucket against the expected bytes of the version
            # the bucket's request names, so it asks wpubd for weight_version on every bucket
            # (SGLang itself is told the version only once the publication ends).
            return 200, {"version": self.args.release, "wpub_bucket_versions": True}
        if session and path == "/begin_weight_update":
            if self.stats["session_open"]:
                self.die("begin_weight_update called while a weight-update session is already "
                         "open")
            self.stats["session_open"] = True
            self.stats["begins"] += 1
            return 200, {"success": True, "message": "Success"}
        if session and path == "/end_weight_update":
            if not self.stats["session_open"]:
                self.die("end_weight_update called without begin_weight_update")
            self.stats["session_open"] = False
            self.stats["ends"] += 1
            return 200, {"success": True, "message": "Success"}
        if session and path == "/update_weights_from_tensor" and not self.stats["session_open"]:
            self.die("update_weights_from_tensor requires an open begin_weight_update session")
        if session and path == "/update_weights_from_distributed" and \
                not self.stats["session_open"]:
            self.die("update_weights_from_distributed requires an open begin_weight_update "
                     "session")
        if path == "/stats":
            return 200, dict(self.stats, held_versions=self.held_versions())
        if path == "/get_model_info":
            return 200, {"model_path": "wpub-emulator", "is_generation": True,
                         "weight_version": self.stats["weight_version"]}
        if path == "/generate":
            if not self.stats["serving"]:
                return 503, {"error": "paused"}
            return 200, {"text": "", "weight_versions": self.held_versions()}
        req = json.loads(body) if body else {}
        routes = {
            "/init_weights_update_group": self.init_group,
            "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_distributed": self.update,
            "/update_weights_from_tensor": self.update_from_tensor,
            "/check": self.check,
            "/bench_recv": self.bench_recv,
        }
        if path in routes:
            with self.lock:  # SGLang serializes weight updates (model_update_lock)
                try:
                    answer = routes[path](req)
                    # SGLang answers success=false with HTTP 400 (http_server.py).
                    return (200 if answer.get("success", True) else 400), answer
                except Exception as e:
                    self.stats["errors"].append(f"{path}: {e}")
                    traceback.print_exc()
                    return 400, {"success": False, "message": str(e)}
        if path == "/update_weight_version":
            self.stats["weight_version"] = req.get("new_version")
            # The tensor route is told the version once, at the end (what it loaded since).
            for name, v in self.live_versions.items():
                if v == "pending":
                    self.live_versions[name] = str(req.get("new_version"))
            return 200, {"success": True, "message": "ok"}
        if path == "/pause_generation":
            return 200, self.pause(req)
        if path == "/continue_generation":
            return 200, self.resume(req)
        if path == "/flush_cache":
            return 200, {"success": True, "message": "ok"}
        return 404, {"success": False, "message": f"no route {path}"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--gpu", type=int, default=1)
    p.add_argument("--expect-dir", default="")
    p.add_argument("--die-at-bucket", type=int, default=None)
    p.add_argument("--fail-at-bucket", type=int, default=None)
    p.add_argument("--fail-version", default=None,
                   help="with --fail-at-bucket: fail that bucket of this version's attempts")
    p.add_argument("--fail-count", type=int, default=1,
                   help="with --fail-version: how many attempts fail")
    p.add_argument("--eager-init", action="store_true", help="pass device_id (eager NCCL init)")
    p.add_argument("--keep", action="store_true", help="keep received tensors (as weights)")
    p.add_argument("--nccl-timeout", type=float, default=120)
    p.add_argument("--tensor-load", default="tensors", choices=["tensors", "bucket"],
                   help="/update_weights_from_tensor: load each tensor into the live weights "
                        "(SGLang's flattened-bucket load), or copy each bucket whole (benchmark)")
    p.add_argument("--timings", action="store_true",
                   help="print each tensor-route bucket's decode+open, load and free times")
    p.add_argument("--tp", type=int, default=1,
                   help="TP ranks whose serialized_named_tensors entries this process decodes")
    p.add_argument("--release", default="0.5.16", choices=["0.5.5", "0.5.6", "0.5.16"],
                   help="0.5.16: the weight-update session, misuse kills the server; 0.5.6: no "
                        "session (begin/end 404); 0.5.5: also no flattened bucket (one "
                        "broadcast per tensor)")
    args = p.parse_args()
    engine = Engine(args)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # SGLang's server (uvicorn) sets TCP_NODELAY; without it every small answer waits for
        # the client's delayed ACK (~40 ms per request), which would be the emulator's artifact.
        disable_nagle_algorithm = True
        wbufsize = 1 << 16  # flushed by handle_one_request after each response

        def _serve(self, method):
            t0 = time.perf_counter()
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else b""
            t_read = time.perf_counter()
            code, obj = engine.handle(method, self.path, body)
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)  # buffered (wbufsize): one send with the headers
            if args.timings and self.path == "/update_weights_from_tensor":
                # The engine's whole time on the request: what the publication waits on.
                print(f"request {self.path}: {n} B, read {t_read - t0:.4f} s, parse+handle+"
                      f"answer {time.perf_counter() - t_read:.4f} s", flush=True)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

        def log_message(self, fmt, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"sglang emulator on :{args.port} gpu {args.gpu} torch {torch.__version__}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

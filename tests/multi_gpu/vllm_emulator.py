#!/usr/bin/env python3
"""A vLLM engine stand-in for wpub's GPU tests, written from vLLM's weight-transfer protocol
(v0.22 and later, NCCL backend; docs/specs/engines.md, "vLLM"), one GPU per engine.

HTTP (Python's http.server): GET /health, /version, /get_world_size, /weight_info, /stats; POST
/init_weight_transfer_engine, /pause, /resume, /start_weight_update, /update_weights,
/finish_weight_update. The rendezvous is StatelessProcessGroup's as a worker sees it: a
TCPStore client (torch) on init_info's master address and port, the pickled ncclUniqueId read at
`broadcast_from/0/0` and unpickled as vLLM's ctypes `ncclUniqueId` (a stand-in module of that
path is registered when vLLM is not installed), ncclCommInitRank through ctypes on libnccl as
rank `rank_offset`, then the one-element float32 sum all-reduce every rank runs. Each
/update_weights receives vLLM's packed chunks (a tensor that takes a chunk past
packed_buffer_size_bytes closes it) as uint8 broadcasts and decodes every tensor as
`chunk[off:off+n].view(dtype).view(shape)`, loading it into the live weights at once (vLLM
cannot roll back either). /finish_weight_update {"weight_version": V} marks the update V and,
with --expect-dir, compares every tensor of it with `<dir>/v<V>/tensors/<name>.bin`.

Failures answer as vLLM's code does: a worker's exception (init_info it refuses, a call out of
phase, a failed receive) is HTTP 500 with the executor's wrapping, and a failed update_weights
ends the update on the worker (a finish then fails, a new start is taken).

--backend ipc: vLLM's IPC weight-transfer backend (colocated engines), from vLLM's
weight_transfer/ipc_engine.py (V4/V5 at 6275f3c2 and 055e47c2: init_info holds only `packed`; V3
at bc293f1a, --release v0.25 here: an empty init_info, `packed` per update) and packed_tensor.py
at 00a9ccfb (packed_ipc_consumer): update_info.ipc_handles_pickled is refused unless
VLLM_ALLOW_INSECURE_SERIALIZATION is set, then unpickled with plain pickle.loads; the packed form
is one dict {GPU UUID: rebuild_cuda_tensor's 15 arguments}; the worker takes its own GPU's entry
("IPC handle not found for GPU UUID" otherwise), writes its device index over argument 6, rebuilds
the tensor with torch's own rebuild_cuda_tensor, splits packed[:sum(tensor_sizes)] by
tensor_sizes, views each piece as dtype and shape, clones it, and synchronizes the device before
it answers (weight_transfer/base.py update_weights).

Test-only switches: --release v0.25 (packing fields refused in init_info, taken per update),
--die-at-update N (SIGKILL itself when its N-th /update_weights, counted from 0 over its life,
arrives: an engine dying mid-publication),
--handshake-only (stop after reading and unpickling the unique id; answer the init without
joining NCCL: what one GPU allows, as the publisher's rank needs a GPU of its own).
GET /stats: calls, per version the tensors, bytes, mismatches; the unique id seen; serving;
resumes on a mix of versions (`mixed_resumes`, a wpub defect)."""
import argparse
import ctypes
import json
import os
import pickle
import signal
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
          "float8_e4m3fn": torch.float8_e4m3fn}


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def register_vllm_stand_in():
    """vLLM's module path for ncclUniqueId, when vLLM itself is not installed."""
    try:
        import vllm.distributed.device_communicators.pynccl_wrapper  # noqa: F401
        return
    except ImportError:
        pass
    names = ["vllm", "vllm.distributed", "vllm.distributed.device_communicators",
             "vllm.distributed.device_communicators.pynccl_wrapper"]
    for n in names:
        sys.modules.setdefault(n, types.ModuleType(n))
    mod = sys.modules[names[-1]]
    NcclUniqueId.__module__ = names[-1]
    NcclUniqueId.__qualname__ = NcclUniqueId.__name__ = "ncclUniqueId"
    mod.ncclUniqueId = NcclUniqueId


def load_nccl():
    try:
        import nvidia.nccl as m
        path = os.path.join(m.__path__[0], "lib", "libnccl.so.2")
    except ImportError:
        path = "libnccl.so.2"
    lib = ctypes.CDLL(path)
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                     NcclUniqueId, ctypes.c_int]
    for f in (lib.ncclBroadcast, lib.ncclAllReduce):
        f.restype = ctypes.c_int
    return lib


def chunks_of(sizes, limit):
    """vLLM's packed rule: [(first tensor, end tensor, bytes)] per chunk."""
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > limit:
            out.append((start, i + 1, total))
            start, total = i + 1, 0
    if total > 0 or not out:
        out.append((start, len(sizes), total))
    return out


class Engine:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda", args.gpu) if torch.cuda.is_available() else None
        self.lock = threading.Lock()
        self.comm = None
        self.nccl = None
        self.packing = {}
        self.updating = False
        self.pending = {}      # name -> host bytes of the update in progress
        self.live = {}         # name -> the version (or update marker) the live weight holds
        self.marker = 0
        self.updates_seen = 0  # /update_weights requests over the emulator's life
        self.updates_in_start = 0
        self.stats = {"failures": 0, "calls": [], "versions": {}, "serving": True,
                      "mixed_resumes": 0,
                      "served": [], "unique_id": None, "unique_id_type": None, "rank": None}

    @staticmethod
    def worker_error(message):
        """What a worker's exception becomes for the HTTP caller: the executor's RuntimeError
        wrapped by the engine core's utility call, a plain Exception answered 500
        (v1/executor/multiproc_executor.py at c5c40ab2, v1/engine/core_client.py at 00080ee1,
        serve/exception_handling/register.py at 8a8be3dc)."""
        return 500, {"error": {"message": "Call to collective_rpc method failed: Worker failed "
                                          f"with error '{message}', please check the stack "
                                          "trace above for the root cause",
                               "type": "InternalServerError", "param": None, "code": 500}}

    # -- rendezvous --------------------------------------------------------------------------
    def init_ipc(self, info):
        allowed = set() if self.args.release == "v0.25" else {"packed"}
        if set(info) - allowed:
            return self.worker_error("Invalid init_info for IPCWeightTransferEngine: unexpected "
                                     f"keyword arguments {sorted(set(info) - allowed)}")
        self.packing = {"packed": bool(info.get("packed", False))}
        return 200, {"message": "Weight transfer initialized"}

    def update_ipc(self, u):
        """ipc_engine.py receive_weights + packed_tensor.py packed_ipc_consumer."""
        import base64
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        allowed = {"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled",
                   "tensor_sizes"}
        if self.args.release == "v0.25":
            allowed.add("packed")
        if set(u) - allowed:
            raise ValueError("Invalid update_info for IPCWeightTransferEngine: unexpected "
                             f"keyword arguments {sorted(set(u) - allowed)}")
        if not os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION"):
            raise ValueError("Refusing to unpickle ipc_handles_pickled: set "
                             "VLLM_ALLOW_INSECURE_SERIALIZATION=1")
        handles = pickle.loads(base64.b64decode(u["ipc_handles_pickled"]))
        packed = u.get("packed", False) if self.args.release == "v0.25" else \
            self.packing.get("packed", False)
        if not packed or not isinstance(handles, dict):
            raise ValueError("this emulator models the packed IPC form only")
        idx = self.device.index
        uuid = str(torch.cuda.get_device_properties(idx).uuid)
        if uuid not in handles:
            raise ValueError(f"IPC handle not found for GPU UUID {uuid}")
        args = list(handles[uuid])
        args[6] = idx
        buf = rebuild_cuda_tensor(*args)
        sizes = u["tensor_sizes"]
        names, dtypes, shapes = u["names"], u["dtype_names"], u["shapes"]
        pieces = buf[:sum(sizes)].split(sizes)
        for name, dt, shp, piece in zip(names, dtypes, shapes, pieces):
            t = piece.contiguous().view(getattr(torch, dt)).view(*shp).clone()
            self.pending[name] = t
            self.live[name] = f"update-{self.marker}"
        del buf, pieces, handles
        torch.cuda.synchronize(self.device)  # base.py: the accelerator synchronizes first

    def init(self, body):
        info = body.get("init_info")
        if not isinstance(info, dict):
            return 400, {"error": {"message": "Missing 'init_info' in request body"}}
        if self.args.backend == "ipc":
            return self.init_ipc(info)
        allowed = {"master_address", "master_port", "rank_offset", "world_size"}
        if self.args.release != "v0.25":
            allowed |= {"packed", "packed_buffer_size_bytes", "packed_num_buffers"}
        if set(info) - allowed:
            # The worker parses init_info (weight_transfer/base.py): its ValueError is a 500.
            return self.worker_error("Invalid init_info for NCCLWeightTransferEngine: unexpected "
                                     f"keyword arguments {sorted(set(info) - allowed)}")
        self.packing = {k: info[k] for k in ("packed", "packed_buffer_size_bytes",
                                             "packed_num_buffers") if k in info}
        rank = int(info["rank_offset"])
        store = torch.distributed.TCPStore(info["master_address"], int(info["master_port"]),
                                           int(info["world_size"]), False,
                                           timeout=__import__("datetime").timedelta(seconds=60))
        uid = pickle.loads(store.get("broadcast_from/0/0"))
        self.stats["unique_id_type"] = f"{type(uid).__module__}.{type(uid).__name__}"
        self.stats["unique_id"] = bytes(uid.internal).hex()
        self.stats["rank"] = rank
        if self.args.handshake_only:
            return 200, {"message": "Weight transfer initialized (handshake only)"}
        self.nccl = load_nccl()
        torch.cuda.set_device(self.device)
        comm = ctypes.c_void_p()
        r = self.nccl.ncclCommInitRank(ctypes.byref(comm), int(info["world_size"]), uid, rank)
        if r != 0:
            return 500, {"error": {"message": f"ncclCommInitRank: {r}"}}
        self.comm = comm
        warm = torch.zeros(1, dtype=torch.float32, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.nccl.ncclAllReduce(ctypes.c_void_p(warm.data_ptr()), ctypes.c_void_p(warm.data_ptr()),
                                1, 7, 0, comm, ctypes.c_void_p(stream))  # float32, sum
        torch.cuda.synchronize(self.device)
        return 200, {"message": "Weight transfer initialized"}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, body):
        if self.updating:  # gpu_worker.py at 6fbea117
            return self.worker_error("start_weight_update called while a weight update is "
                                     "already active. Call finish_weight_update first.")
        self.updating = True
        self.marker += 1
        self.updates_in_start = 0
        self.pending = {}
        return 200, {"message": "Weight update started"}

    def update(self, body):
        self.updates_seen += 1
        if self.args.die_at_update is not None and self.updates_seen - 1 == self.args.die_at_update:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if not self.updating:
            return self.worker_error("start_weight_update must be called before "
                                     "update_weights.")
        u = body["update_info"]
        names, dtypes, shapes = u["names"], u["dtype_names"], u["shapes"]
        index = self.updates_in_start
        self.updates_in_start += 1
        # --fail-at-update N --fail-after-starts S --fail-count K: update N of the updates after
        # the first S starts fails, K times, after it loaded its bytes (a loader error: the
        # worker raises and leaves the update, the HTTP answer is 500).
        fail_here = (self.args.fail_at_update is not None and index == self.args.fail_at_update
                     and self.marker > self.args.fail_after_starts
                     and self.stats["failures"] < self.args.fail_count)
        if self.args.backend == "ipc":
            self.update_ipc(u)
            if fail_here:
                self.stats["failures"] += 1
                raise RuntimeError("loading the update failed (test fault)")
            return 200, {"message": "Weights updated"}
        limit = u.get("packed_buffer_size_bytes",
                      self.packing.get("packed_buffer_size_bytes", 1 << 30))
        sizes = []
        for dt, shp in zip(dtypes, shapes):
            n = torch.empty(0, dtype=DTYPES[dt]).element_size()
            for d in shp:
                n *= d
            sizes.append(n)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for first, end, total in chunks_of(sizes, limit):
            buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            r = self.nccl.ncclBroadcast(ctypes.c_void_p(buf.data_ptr()),
                                        ctypes.c_void_p(buf.data_ptr()), total, 1, 0, self.comm,
                                        ctypes.c_void_p(stream))
            if r != 0:
                self.updating = False  # a failed update_weights ends the update on the worker
                return self.worker_error(f"ncclBroadcast: {r}")
            torch.cuda.synchronize(self.device)
            off = 0
            for k in range(first, end):
                t = buf[off:off + sizes[k]].view(DTYPES[dtypes[k]]).view(*shapes[k])
                self.pending[names[k]] = t.view(torch.uint8).flatten().cpu().numpy().tobytes()
                self.live[names[k]] = f"update-{self.marker}"  # loaded on receipt
                off += sizes[k]
        if fail_here:
            self.stats["failures"] += 1
            raise RuntimeError("loading the update failed (test fault)")
        return 200, {"message": "Weights updated"}

    def finish(self, body):
        version = body.get("weight_version") if isinstance(body, dict) else None
        if not self.updating:  # a failed update_weights already ended it on the worker
            return self.worker_error("finish_weight_update called without a matching "
                                     "start_weight_update.")
        self.updating = False
        if version is None:  # an aborted update: nothing is applied by name here
            self.pending = {}
            return 200, {"message": "Weight update finished"}
        v = self.stats["versions"].setdefault(str(version), {"tensors": 0, "bytes": 0,
                                                              "checked": 0, "mismatches": []})
        for name, got in self.pending.items():
            if isinstance(got, torch.Tensor):  # the IPC backend's clone
                got = got.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
            v["tensors"] += 1
            v["bytes"] += len(got)
            self.live[name] = str(version)
            if self.args.expect_dir:
                path = os.path.join(self.args.expect_dir, f"v{version}", "tensors", name + ".bin")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        want = f.read()
                    v["checked"] += 1
                    if want != got:
                        v["mismatches"].append(name)
                else:
                    v["mismatches"].append(f"{name}: no expectation")
        for name, held in self.live.items():
            if held == f"update-{self.marker}":
                self.live[name] = str(version)
        self.pending = {}
        return 200, {"message": "Weight update finished"}

    def resume(self):
        held = sorted(set(self.live.values()))
        self.stats["serving"] = True
        self.stats["served"].append(held)
        if len(held) > 1:
            self.stats["mixed_resumes"] += 1
        return 200, {"status": "resumed"}

    def handle(self, method, path, query, body):
        with self.lock:
            self.stats["calls"].append(path)
            if method == "GET":
                if path == "/health":
                    return 200, {}
                if path == "/version":
                    return 200, {"version": "0.28.0-wpub-emulator" if self.args.release == "main"
                                 else "0.25.1-wpub-emulator"}
                if path == "/server_info":
                    # serve/dev/server_info/api_router.py at
                    # c67fe497a25d5af10a6ca0be9d18bcdd42cac4f1: the config (JSON with
                    # config_format=json, else its str) beside the environment.
                    config = {"weight_transfer_config": {"backend": self.args.backend}}
                    if query.get("config_format", ["text"])[0] != "json":
                        config = str(config)
                    return 200, {"vllm_config": config, "vllm_env": {}, "system_env": ""}
                if path == "/get_world_size":
                    return 200, {"world_size": 1}
                if path == "/weight_info":
                    versions = sorted({v for v in self.live.values() if v.isdigit()}, key=int)
                    return 200, {"weight_version": versions[-1] if versions else None}
                if path == "/stats":
                    return 200, self.stats
                if path in ("/init_weight_transfer_engine", "/start_weight_update",
                            "/update_weights", "/finish_weight_update", "/pause", "/resume"):
                    # POST routes: FastAPI answers another method 405 (wpubd's join probe).
                    return 405, {"detail": "Method Not Allowed"}
                return 404, {"detail": "Not Found"}
            routes = {"/init_weight_transfer_engine": self.init,
                      "/start_weight_update": self.start,
                      "/update_weights": self.update,
                      "/finish_weight_update": self.finish}
            if path == "/pause":
                self.stats["serving"] = False
                return 200, {"status": "paused"}
            if path == "/resume":
                return self.resume()
            if path in routes:
                try:
                    return routes[path](body)
                except Exception as e:  # noqa: BLE001 -- answered like vLLM's handlers
                    if path == "/update_weights":
                        self.updating = False  # the worker leaves the update it failed
                    return self.worker_error(f"{type(e).__name__}: {e}")
            return 404, {"detail": "Not Found"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--gpu", type=int, default=1)
    p.add_argument("--expect-dir", default="")
    p.add_argument("--release", default="main", choices=["main", "v0.25"])
    p.add_argument("--backend", default="nccl", choices=["nccl", "ipc"],
                   help="ipc: the IPC weight-transfer backend (a colocated engine)")
    p.add_argument("--handshake-only", action="store_true")
    p.add_argument("--die-at-update", type=int, default=None)
    p.add_argument("--fail-at-update", type=int, default=None)
    p.add_argument("--fail-after-starts", type=int, default=1)
    p.add_argument("--fail-count", type=int, default=1)
    args = p.parse_args()
    register_vllm_stand_in()
    engine = Engine(args)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method):
            u = urlparse(self.path)
            n = int(self.headers.get("Content-Length", 0) or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw else {}
            except json.JSONDecodeError:
                status, out = 400, {"error": {"message": "Invalid JSON format"}}
            else:
                status, out = engine.handle(method, u.path, parse_qs(u.query), body)
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply("GET")

        def do_POST(self):
            self._reply("POST")

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()

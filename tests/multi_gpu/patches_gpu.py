#!/usr/bin/env python3
"""Bucket patches on the GPU path (wpubd --gpu_path --retain=device --patches): a GLM-like MoE
published from torch CUDA tensors through CUDA IPC to two wpub-recv receivers, one accepting
patches, one pulling whole buckets. Each version after the first moves one routed expert of every
MoE layer (v3 moves nothing; v4 is the --patches_full_every=3rd and goes whole). After every
version both receivers' files equal the CPU reference byte for byte; the patched receiver's log
says what each version cost it on the wire: a small share of the bytes when an expert moved, a
48-byte header per bucket when nothing did, everything on the whole version. On the GPU path the patches are made on the
device, between the retained copy and the staging one in device memory (only the patch is read
back): the daemon's log must show no patch that fell back to host copies.

Writes OUT/patches_gpu.json; exit 0 when every check holds.
Usage (a GPU host, binaries staged; see tests/gpu/run_one_gpu.sh):
    WPUBD=... WPUB_RECV=... WPUB_QUANTIZE_REF=... python3 tests/multi_gpu/patches_gpu.py OUT_DIR
    [--cpu]   (the CPU path, --retain=host, numpy inputs: the same checks without a GPU)
"""
import json
import os
import re
import shutil
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
import wpub  # noqa: E402
from harness import (Daemon, Receiver, as_wire, bf16, glm_batches,  # noqa: E402
                     read_safetensors, reference, wait_for_receivers)

BUCKET = 256 << 10


def moved(model, expert, seed):
    """The model with routed expert `expert` of every MoE layer drawn again."""
    rng = np.random.default_rng(seed)
    return [(m, [(n, bf16(rng, a.shape) if f".mlp.experts.{expert}." in n else a)
                 for n, a in ts]) for m, ts in model]


def wait_file(path, version, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            tensors, meta = read_safetensors(path)
            if int(meta.get("version", 0)) == version:
                return tensors
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{path} did not reach v{version}")


def pulled(log_path, version):
    """(bytes pulled, buckets from patches) the receiver logged for `version`."""
    pat = re.compile(rf"committed v{version} \((\d+) buckets, (\d+) bytes; pulled (\d+) bytes, "
                     rf"(\d+) buckets from patches\)")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(log_path) as f:
            m = pat.search(f.read())
        if m:
            return int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
        time.sleep(0.05)
    raise RuntimeError(f"{log_path}: no commit line for v{version}")


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cpu = "--cpu" in sys.argv[1:]
    out = args[0] if args else "/tmp/wpub_patches_gpu"
    shutil.rmtree(out, ignore_errors=True)  # a receiver's file from a run before holds v5
    os.makedirs(out)
    path = ["--retain=host"] if cpu else ["--gpu_path", "--gpu_device=0", "--retain=device"]
    d = Daemon(out, *path, "--patches", "--patches_full_every=3", timeout=90)
    patched = Receiver(d, "patched", "--log_level=info")
    whole = Receiver(d, "whole", "--patches=false")
    pub = wpub.Publisher(d.target, timeout=300)
    res = {"versions": [], "ok": True}
    try:
        wait_for_receivers(pub, 2)
        model = glm_batches(11, hidden=256, inter=128, experts=8)
        plan = [(1, None), (2, 3), (3, None), (4, 5), (5, 1)]
        for version, expert in plan:
            if expert is not None:
                model = moved(model, expert, 1000 + version)
            if cpu:
                inputs = as_wire(model)
            else:
                from harness import bf16_cuda
                inputs = [(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in model]
            r = pub.publish(version, inputs, bucket_bytes=BUCKET, check=False)
            want = reference(out, model)
            got_p = wait_file(patched.output, version)
            got_w = wait_file(whole.output, version)
            same = (set(got_p) == set(want) == set(got_w) and
                    all(got_p[k][2] == want[k][2] == got_w[k][2] for k in want))
            buckets, total, wire, from_patches = pulled(patched.log_path, version)
            entry = {"version": version, "moved_expert": expert, "status": r.status,
                     "bytes_out": r.raw.bytes_out, "buckets": buckets, "pulled_bytes": wire,
                     "buckets_from_patches": from_patches, "identical": same,
                     "pulled_over_full": wire / total if total else 0}
            if version in (1, 4):
                ok = from_patches == 0 and wire == total
            elif expert is None:
                ok = from_patches == buckets and wire == 48 * buckets
            else:
                ok = from_patches > buckets // 2 and wire * 4 < total
            entry["ok"] = bool(r.committed and same and ok)
            res["ok"] &= entry["ok"]
            res["versions"].append(entry)
            print(json.dumps(entry), flush=True)
        status = pub.status()
        res["retained"] = {"where": status.retained.where, "version": status.retained.version,
                           "held_bytes": status.retained.held_bytes}
        res["ok"] &= (status.retained.where == ("host" if cpu else "device") and
                      status.retained.version == 5)
    finally:
        pub.close()
        for p in (patched, whole):
            p.stop()
        res["daemon_exit"] = d.stop()
    res["ok"] &= res["daemon_exit"] == 0
    with open(d.log_path, "rb") as f:
        fell_back = f.read().decode(errors="replace").count("diffing host copies")
    res["patches_from_host_copies"] = fell_back
    res["ok"] &= fell_back == 0
    with open(os.path.join(out, "patches_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    sys.exit(0 if res["ok"] else 1)


if __name__ == "__main__":
    main()

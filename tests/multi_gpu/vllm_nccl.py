#!/usr/bin/env python3
"""wpubd on GPU 0 to the vLLM emulator on harness.engine_gpu() (GPU 1, or GPU 0 itself on a machine
of one GPU: every process then its own NCCL host identity, harness.nccl_env) over vLLM's own
weight-transfer protocol: three versions of a GLM-like MoE from torch CUDA tensors (CUDA IPC),
every tensor the emulator received equal to the CPU reference byte for byte, the lifecycle once per
version and no resume on a mix; a version with a non-finite weight is rejected before any byte
reaches the engine; then the same against an emulator of a release that takes the packing fields
per update (--release v0.25); then an emulator that dies at its second update request: the version
aborts within the deadline, and the next one commits to the engine restarted at the same address;
then the C++ vLLM-protocol engine (wpub-recv --engine_listen --engine_protocol=vllm) at both
placements, its --output file checked against the reference after each version. Writes
OUT/vllm_nccl.json; exit 0 when every check holds.

Usage (a GPU host, binaries staged): see tests/gpu/run_one_gpu.sh.
"""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
import wpub  # noqa: E402
from harness import (Daemon, bf16_cuda, engine_gpu, free_port, glm_batches,  # noqa: E402
                     http_json as get, nccl_env, reference, wait_http)

GPU = engine_gpu()
SHARED = GPU == 0  # the engines share wpubd's GPU



def start_daemon(out, url, *flags):
    """A GPU-path wpubd on GPU 0 with the vLLM engine at `url` (once it answers /health), and a
    publisher to it."""
    wait_http(url + "/health", 30)
    d = Daemon(out, "--gpu_path", "--gpu_device=0", f"--engines=vllm+{url}",
               "--nccl_store_listen=127.0.0.1:0", *flags, log_level="info", timeout=60,
               env=nccl_env(SHARED))
    return d, wpub.Publisher(d.target, timeout=300)


def start_emulator(out, port, tag, *flags):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_emulator.py"),
                             f"--port={port}", f"--gpu={GPU}", *flags],
                            stdout=open(os.path.join(out, f"emulator-{tag}.log"), "a"),
                            stderr=subprocess.STDOUT, env=nccl_env(SHARED))


def write_expected(expect, version, ref):
    vdir = os.path.join(expect, f"v{version}", "tensors")
    os.makedirs(vdir, exist_ok=True)
    for name, (_, _, raw) in ref.items():
        with open(os.path.join(vdir, name + ".bin"), "wb") as f:
            f.write(raw)


def run(out, release):
    expect = os.path.join(out, f"expect-{release}")
    port = free_port()
    emu = start_emulator(out, port, release, f"--expect-dir={expect}", f"--release={release}")
    url = f"http://127.0.0.1:{port}"
    d, pub = start_daemon(out, url)
    res = {"release": release, "versions": [], "ok": True}
    try:
        for version in (1, 2, 3):
            model = glm_batches(version, hidden=256, inter=128, experts=8)
            ref = reference(out, model)
            write_expected(expect, version, ref)
            wire = [(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in model]
            r = pub.publish(version, wire, bucket_bytes=1 << 20, check=False)
            s = get(url + "/stats")
            v = s["versions"].get(str(version), {})
            entry = {"version": version, "status": r.status, "wall_seconds": r.wall_seconds,
                     "tensors": len(ref), "checked": v.get("checked"),
                     "mismatches": v.get("mismatches", [])[:5],
                     "mixed_resumes": s["mixed_resumes"]}
            entry["ok"] = (r.committed and entry["checked"] == len(ref) and
                           not entry["mismatches"] and s["mixed_resumes"] == 0)
            res["ok"] &= entry["ok"]
            res["versions"].append(entry)
            print(json.dumps(entry))
        # A NaN in one expert: rejected, nothing of it reaches the engine.
        model = glm_batches(9, hidden=256, inter=128, experts=8)
        for m, ts in model:
            for n, a in ts:
                if ".mlp.experts.3.down_proj" in n:
                    a[0, 0] = 0x7FC0  # bf16 NaN
        before = get(url + "/stats")["calls"].count("/update_weights")
        wire = [(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in model]
        try:
            pub.publish(4, wire, bucket_bytes=1 << 20)
            res["non_finite"] = "published (defect)"
            res["ok"] = False
        except wpub.WpubError as e:
            after = get(url + "/stats")["calls"].count("/update_weights")
            res["non_finite"] = {"error": str(e)[:200], "updates_reached_engine": after - before}
            res["ok"] &= "experts.3.down_proj" in str(e) and after == before
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        emu.terminate()
        emu.wait(10)
    return res


def run_killed(out):
    """An engine that dies at its second update request (bucket 1 of version 1): the version
    aborts within the deadline with the engine named, then the engine restarted at the same
    address takes version 2 byte for byte (the daemon re-forms the group) and resumes once on
    it, never on a mix."""
    expect = os.path.join(out, "expect-killed")
    port = free_port()
    emu = start_emulator(out, port, "killed", f"--expect-dir={expect}", "--die-at-update=1")
    url = f"http://127.0.0.1:{port}"
    d, pub = start_daemon(out, url, "--engine_deadline=20s")
    res = {"release": "killed", "ok": True}
    try:
        model = glm_batches(21, hidden=256, inter=128, experts=8)
        wire = [(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in model]
        t0 = time.monotonic()
        try:
            r = pub.publish(1, wire, bucket_bytes=256 << 10, check=False)
            res["killed"] = {"status": r.status, "error": r.error_message[:300]}
            aborted = not r.committed
        except wpub.WpubError as e:
            res["killed"] = {"error": str(e)[:300]}
            aborted = True
        res["killed"]["seconds"] = round(time.monotonic() - t0, 3)
        res["killed"]["engine_exited"] = emu.wait(30) is not None
        res["ok"] &= aborted and res["killed"]["seconds"] < 60 and res["killed"]["engine_exited"]
        emu = start_emulator(out, port, "killed", f"--expect-dir={expect}")
        wait_http(url + "/health", 60)
        model = glm_batches(22, hidden=256, inter=128, experts=8)
        ref = reference(out, model)
        write_expected(expect, 2, ref)
        wire = [(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in model]
        r = pub.publish(2, wire, bucket_bytes=256 << 10, check=False)
        s = get(url + "/stats")
        v = s["versions"].get("2", {})
        res["next"] = {"status": r.status, "error": r.error_message[:300], "tensors": len(ref),
                       "checked": v.get("checked"), "mismatches": v.get("mismatches", [])[:5],
                       "serving": s["serving"], "served": s["served"],
                       "mixed_resumes": s["mixed_resumes"]}
        res["ok"] &= (r.committed and v.get("checked") == len(ref) and not v.get("mismatches")
                      and s["serving"] and s["mixed_resumes"] == 0)
        print(json.dumps(res))
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        emu.terminate()
        emu.wait(10)
    return res


def read_safetensors(path):
    """{name: bytes} and the metadata of a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    body = data[8 + n:]
    return {k: body[v["data_offsets"][0]:v["data_offsets"][1]] for k, v in header.items()}, meta


def run_cpp(out, packing_in_init):
    """The C++ vLLM-protocol engine on the engine GPU: three versions, its output byte for
    byte."""
    tag = "cpp-init" if packing_in_init else "cpp-update"
    port = free_port()
    target = os.path.join(out, f"{tag}.safetensors")
    eng = subprocess.Popen([os.environ["WPUB_RECV"], f"--engine_listen=127.0.0.1:{port}",
                            "--engine_protocol=vllm", f"--gpu_device={GPU}", f"--output={target}",
                            f"--vllm_packing_in_init={'true' if packing_in_init else 'false'}"],
                           stdout=open(os.path.join(out, f"{tag}.log"), "w"),
                           stderr=subprocess.STDOUT, env=nccl_env(SHARED))
    url = f"http://127.0.0.1:{port}"
    d, pub = start_daemon(out, url)
    res = {"release": tag, "versions": [], "ok": True}
    try:
        for version in (1, 2, 3):
            model = glm_batches(version, hidden=256, inter=128, experts=8)
            ref = reference(out, model)
            wire = [(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in model]
            r = pub.publish(version, wire, bucket_bytes=1 << 20, check=False)
            got, meta = read_safetensors(target)
            bad = [n for n, (_, _, raw) in ref.items() if got.get(n) != raw]
            entry = {"version": version, "status": r.status, "wall_seconds": r.wall_seconds,
                     "tensors": len(ref), "held": len(got), "file_version": meta.get("version"),
                     "mismatches": bad[:5]}
            entry["ok"] = (r.committed and not bad and len(got) == len(ref) and
                           meta.get("version") == str(version))
            res["ok"] &= entry["ok"]
            res["versions"].append(entry)
            print(json.dumps(entry))
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        eng.terminate()
        eng.wait(10)
    return res


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/wpub_vllm_nccl"
    os.makedirs(out, exist_ok=True)
    results = [run(out, "main"), run(out, "v0.25"), run_killed(out), run_cpp(out, True),
               run_cpp(out, False)]
    with open(os.path.join(out, "vllm_nccl.json"), "w") as f:
        json.dump(results, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()

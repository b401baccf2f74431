#!/usr/bin/env python3
"""Two NCCL runs of a GPU-path wpubd on GPU 0 with engines on harness.engine_gpu() (GPU 1, or
GPU 0 itself on a machine of one GPU: every process then its own NCCL host identity,
harness.nccl_env):

1. SGLang and vLLM engines in one publication: the SGLang emulator and the vLLM emulator,
   connected by one --engines list (each family its own weight-update group and store), take
   three versions of a GLM-like MoE from torch CUDA tensors; every tensor each engine received
   equals the CPU reference byte for byte, each engine was paused and resumed once per version
   and never resumed on a mix.
2. For each SGLang release the emulator models (0.5.16 with the weight-update session, 0.5.6
   without, 0.5.5 without the flattened bucket), an aborted attempt leaves the engine paused
   and dirty, and the retry commits: the SGLang emulator fails bucket 2 of the first attempt after loading half of it (SGLang's
   "partially updated" answer); the daemon keeps the engine paused (no resume on the mix),
   retries the version within the same publication (the inputs are still held) and commits it
   on the second attempt; the engine then holds that one version, byte for byte, and serves it.
   A second version commits on the first attempt. Every session opened was closed and the
   engine process lived throughout (0.5.16 kills itself on a begin over an open session).

Writes OUT/engines_nccl.json; exit 0 when every check holds.
Usage (a GPU host, binaries staged; see tests/gpu/run_one_gpu.sh):
    WPUBD=... WPUB_QUANTIZE_REF=... python3 tests/multi_gpu/engines_nccl.py OUT_DIR
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
import wpub  # noqa: E402
from harness import (Daemon, bf16_cuda, engine_gpu, free_port, glm_batches,  # noqa: E402
                     http_json as get, nccl_env, reference, wait_http)

GPU = engine_gpu()
SHARED = GPU == 0  # the engines share wpubd's GPU


def emulator(out, script, tag, *flags):
    """An engine emulator on the engine GPU; (process, url) once it answers /health."""
    port = free_port()
    p = subprocess.Popen([sys.executable, os.path.join(HERE, script), f"--port={port}",
                          f"--gpu={GPU}", *flags],
                         stdout=open(os.path.join(out, f"{tag}.log"), "w"),
                         stderr=subprocess.STDOUT, env=nccl_env(SHARED))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 120)
    return p, url


def expect(out, tag, version, ref):
    """The reference bytes of every tensor where the emulators look for them."""
    vdir = os.path.join(out, f"expect-{tag}", f"v{version}", "tensors")
    os.makedirs(vdir, exist_ok=True)
    for name, (_, _, raw) in ref.items():
        with open(os.path.join(vdir, name + ".bin"), "wb") as f:
            f.write(raw)


def version_of(seed):
    model = glm_batches(seed, hidden=256, inter=128, experts=8)
    return model, [(m, [(n, bf16_cuda(a)) for n, a in ts]) for m, ts in model]


def mixed_families(out):
    """SGLang and vLLM engines in one publication."""
    res = {"run": "sglang+vllm", "versions": [], "ok": True}
    sg, sg_url = emulator(out, "sglang_emulator.py", "mixed-sglang",
                          f"--expect-dir={os.path.join(out, 'expect-mixed')}")
    vl, vl_url = emulator(out, "vllm_emulator.py", "mixed-vllm",
                          f"--expect-dir={os.path.join(out, 'expect-mixed')}")
    d = Daemon(out, "--gpu_path", "--gpu_device=0", f"--engines={sg_url},vllm+{vl_url}",
               "--nccl_store_listen=127.0.0.1:0", log_level="info", timeout=90,
               env=nccl_env(SHARED))
    pub = wpub.Publisher(d.target, timeout=300)
    try:
        for version in (1, 2, 3):
            model, wire = version_of(40 + version)
            ref = reference(out, model)
            expect(out, "mixed", version, ref)
            r = pub.publish(version, wire, bucket_bytes=1 << 20, check=False)
            s, v = get(sg_url + "/stats"), get(vl_url + "/stats")
            sv = s["versions"].get(str(version), {})
            vv = v["versions"].get(str(version), {})
            entry = {"version": version, "status": r.status, "error": r.error_message[:300],
                     "receivers": sorted((o.name, o.committed) for o in r.receivers),
                     "tensors": len(ref),
                     "sglang": {"checked": sv.get("checked"),
                                "mismatches": sv.get("mismatches", [])[:5],
                                "pauses": s["calls"].count("/pause_generation"),
                                "resumes": s["calls"].count("/continue_generation"),
                                "mixed_resumes": s["mixed_resumes"]},
                     "vllm": {"checked": vv.get("checked"),
                              "mismatches": vv.get("mismatches", [])[:5],
                              "pauses": v["calls"].count("/pause"),
                              "resumes": v["calls"].count("/resume"),
                              "mixed_resumes": v["mixed_resumes"]},
                     "wall_seconds": r.wall_seconds,
                     # Both families read the device buckets: no host copy per bucket, so
                     # the publication's own syncs only (the first also allocates buffers).
                     "host_syncs": r.host_syncs, "buckets": r.num_buckets}
            ok = r.committed and len(r.receivers) == 2 and all(o.committed for o in r.receivers)
            if version > 1:
                ok &= r.host_syncs < r.num_buckets
            for fam in ("sglang", "vllm"):
                e = entry[fam]
                ok &= (e["checked"] == len(ref) and not e["mismatches"] and
                       e["pauses"] == version and e["resumes"] == version and
                       e["mixed_resumes"] == 0)
            entry["ok"] = ok
            res["ok"] &= ok
            res["versions"].append(entry)
            print(json.dumps(entry), flush=True)
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        for p in (sg, vl):
            p.terminate()
            p.wait(10)
    res["ok"] &= res["daemon_exit"] == 0
    return res


def dirty_then_retry(out, release):
    """An SGLang engine of `release` dirty after a failed attempt, kept paused, then the retry
    commits; its weight-update sessions (0.5.16) always closed, the server never killed."""
    res = {"run": f"sglang {release} dirty, retry commits", "ok": True}
    tag = f"dirty-{release}"
    sg, url = emulator(out, "sglang_emulator.py", tag,
                       f"--expect-dir={os.path.join(out, 'expect-' + tag)}", "--fail-at-bucket=2",
                       f"--release={release}")
    d = Daemon(out, "--gpu_path", "--gpu_device=0", f"--engines={url}",
               "--nccl_store_listen=127.0.0.1:0", log_level="info", timeout=90,
               env=nccl_env(SHARED))
    pub = wpub.Publisher(d.target, timeout=300)
    try:
        for version in (1, 2):
            model, wire = version_of(60 + version)
            ref = reference(out, model)
            expect(out, tag, version, ref)
            r = pub.publish(version, wire, bucket_bytes=256 << 10, check=False)
            s = get(url + "/stats")
            v = s["versions"].get(str(version), {})
            entry = {"version": version, "status": r.status, "error": r.error_message[:300],
                     "attempts": r.raw.attempts, "retry_errors": list(r.raw.retry_errors)[:3],
                     "buckets": r.num_buckets, "tensors": len(ref),
                     "checked": v.get("checked"), "mismatches": v.get("mismatches", []),
                     "served": s["served"], "serving": s["serving"],
                     "held_versions": s["held_versions"], "mixed_resumes": s["mixed_resumes"],
                     "resumes": s["calls"].count("/continue_generation"),
                     "session_open": s["session_open"], "begins": s["begins"],
                     "ends": s["ends"], "alive": sg.poll() is None}
            # The first attempt failed at bucket 2 after loading half of it; the retry re-sent
            # every bucket, so the engine checked the first attempt's tensors too (the same
            # version's bytes): at least every tensor once, none differing. It never resumed on
            # a mix and holds exactly version `version`.
            ok = (r.committed and (v.get("checked") or 0) >= len(ref) and
                  not entry["mismatches"] and s["mixed_resumes"] == 0 and
                  s["serving"] and s["held_versions"] == [str(version)] and
                  entry["resumes"] == version and entry["alive"] and
                  not entry["session_open"] and entry["begins"] == entry["ends"] and
                  (entry["begins"] > 0) == (release == "0.5.16"))
            if version == 1:
                ok &= r.raw.attempts == 2 and len(entry["retry_errors"]) == 1
            else:
                ok &= r.raw.attempts == 1
            entry["ok"] = ok
            res[f"v{version}"] = entry
            res["ok"] &= ok
            print(json.dumps(entry), flush=True)
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        sg.terminate()
        sg.wait(10)
    res["ok"] &= res["daemon_exit"] == 0
    return res


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/wpub_engines_nccl"
    os.makedirs(out, exist_ok=True)
    results = []
    runs = [("mixed_families", mixed_families)] + [
        (f"dirty_then_retry {r}", lambda o, r=r: dirty_then_retry(o, r))
        for r in ("0.5.16", "0.5.6", "0.5.5")]
    for name, run in runs:
        try:
            results.append(run(out))
        except Exception as e:  # noqa: BLE001 -- one run's failure is reported, the next runs
            results.append({"run": name, "ok": False, "exception": repr(e)[:500]})
            print(json.dumps(results[-1]), flush=True)
    with open(os.path.join(out, "engines_nccl.json"), "w") as f:
        json.dump(results, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()

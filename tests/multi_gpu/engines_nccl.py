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
3. For an SGLang engine with the retained copy in device memory (--retain=device) and in host
   memory (--retain=host), and a vLLM engine with it in pinned memory (--retain=pinned): every
   attempt of v2 fails after the engine loaded part of it; the daemon restores the retained v1
   over NCCL and the engine serves v1 alone, byte for byte; the engine restarts empty, joins
   with connect_engines and is caught up to v1 without a publication; v3 then commits, and
   status says where the copy lives and what it holds.

Writes OUT/engines_nccl.json; exit 0 when every check holds.
Usage (a GPU host, binaries staged; see tests/gpu/run_one_gpu.sh):
    WPUBD=... WPUB_QUANTIZE_REF=... python3 tests/multi_gpu/engines_nccl.py OUT_DIR
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


def restore_and_catch_up(out, family, where):
    """--retain=WHERE: every attempt of v2 fails at a bucket after the engine of `family` loaded
    part of it, so v2 aborts with the engine dirty; the daemon restores the retained v1 over
    NCCL (the engine's own lifecycle, bytes checked against v1's reference) and resumes it on
    v1 alone. Then the engine restarts (a new process, holding nothing) and joins with
    connect_engines: it is caught up to v1 without the trainer publishing. v3 then commits."""
    res = {"run": f"{family} restored after an abort, restarted and caught up ({where})",
           "ok": True}
    tag = f"restore-{family}-{where}"
    exp = os.path.join(out, "expect-" + tag)
    if family == "sglang":
        script, prefix = "sglang_emulator.py", ""
        faults = ["--fail-at-bucket=1", "--fail-version=2", "--fail-count=3"]
    else:
        script, prefix = "vllm_emulator.py", "vllm+"
        faults = ["--fail-at-update=1", "--fail-after-starts=1", "--fail-count=3"]
    models = {}
    for version in (1, 2, 3):
        models[version] = version_of(80 + version)
        expect(out, tag, version, reference(out, models[version][0]))
    eng, url = emulator(out, script, tag, f"--expect-dir={exp}", *faults)
    procs = [eng]
    d = Daemon(out, "--gpu_path", "--gpu_device=0", f"--engines={prefix}{url}", f"--retain={where}",
               "--nccl_store_listen=127.0.0.1:0", log_level="info", timeout=90,
               env=nccl_env(SHARED))
    pub = wpub.Publisher(d.target, timeout=300)

    def replays(kind, n):
        deadline = time.monotonic() + 120
        while True:
            r = [x for x in pub.status().recent_replays if x.kind == kind]
            if len(r) >= n or time.monotonic() > deadline:
                return r
            time.sleep(0.1)

    def holds(s, version):
        """The engine serves `version` alone, checked byte for byte, never resumed on a mix."""
        v = s["versions"].get(str(version), {})
        if family == "sglang":
            alone = s["held_versions"] == [str(version)] and not s["session_open"] and (
                s["begins"] == s["ends"])
        else:
            alone = bool(s["served"]) and s["served"][-1] == [str(version)]
        return (alone and s["serving"] and s["mixed_resumes"] == 0 and
                (v.get("checked") or 0) > 0 and not v.get("mismatches"))

    try:
        r1 = pub.publish(1, models[1][1], bucket_bytes=256 << 10, check=False)
        r2 = pub.publish(2, models[2][1], bucket_bytes=256 << 10, check=False)
        restored = replays("restore", 1)
        s = get(url + "/stats")
        entry = {"v1": r1.status, "v2": r2.status, "v2_attempts": r2.raw.attempts,
                 "restore": [(x.completed, x.version, x.error[:200]) for x in restored],
                 "failures": s["failures"], "holds_v1": holds(s, 1)}
        ok = (r1.committed and not r2.committed and len(restored) == 1 and
              restored[0].completed and restored[0].version == 1 and entry["holds_v1"])
        # The restarted engine: a new process on a new port, holding nothing.
        eng.terminate()
        eng.wait(10)
        eng2, url2 = emulator(out, script, tag + "-restarted", f"--expect-dir={exp}")
        procs.append(eng2)
        pub.connect_engines([prefix + url2])
        caught = replays("catch_up", 1)
        s2 = get(url2 + "/stats")
        entry.update({"catch_up": [(x.completed, x.version, x.error[:200]) for x in caught],
                      "restarted_holds_v1": holds(s2, 1)})
        ok &= (len(caught) >= 1 and caught[0].completed and caught[0].version == 1 and
               entry["restarted_holds_v1"])
        r3 = pub.publish(3, models[3][1], bucket_bytes=256 << 10, check=False)
        s3 = get(url2 + "/stats")
        retained = pub.status().retained
        entry.update({"v3": r3.status, "holds_v3": holds(s3, 3),
                      "status_retained": retained.version, "where": retained.where,
                      "bytes": retained.bytes, "held_bytes": retained.held_bytes})
        # device / pinned: the retained v3 and the buffer v2's staging left (reused for v4).
        ok &= (r3.committed and entry["holds_v3"] and entry["status_retained"] == 3 and
               retained.where == where and retained.held_bytes >= retained.bytes > 0)
        entry["ok"] = ok
        res.update(entry)
        res["ok"] &= ok
        print(json.dumps(entry), flush=True)
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    res["ok"] &= res["daemon_exit"] == 0
    return res


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/wpub_engines_nccl"
    os.makedirs(out, exist_ok=True)
    results = []
    runs = [("mixed_families", mixed_families)] + [
        (f"dirty_then_retry {r}", lambda o, r=r: dirty_then_retry(o, r))
        for r in ("0.5.16", "0.5.6", "0.5.5")] + [
        (f"restore_and_catch_up {f} {w}", lambda o, f=f, w=w: restore_and_catch_up(o, f, w))
        for f, w in (("sglang", "device"), ("vllm", "pinned"), ("sglang", "host"))]
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

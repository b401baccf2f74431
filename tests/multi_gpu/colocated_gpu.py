#!/usr/bin/env python3
"""Colocated engines on ONE GPU: a GPU-path wpubd hands every bucket to SGLang emulators on the
same device through CUDA IPC (`sglang-ipc+http://...`, /update_weights_from_tensor: the
emulator's deserializer, allowlist, UUID device mapping and flattened-bucket rebuild are
SGLang's, the tensors torch's own rebuild_cuda_tensor), no NCCL anywhere:

1. three versions of a GLM-like MoE to an engine of 1 TP rank and one of 2 (then, with a vLLM
   emulator on vLLM's IPC weight-transfer backend -- packing at init, and per update as v0.25
   takes it -- beside an SGLang one in the same publication): after each, every
   weight each rank holds equals the CPU reference byte for byte, each engine was paused and
   resumed once per version, never on a mix, and its weight-update session always closed;
   the daemon's buckets were released only after torch's reference counters said so (no
   "still hold" failure), and no host copy was made per bucket;
2. an engine killed mid-handover (SIGKILL when bucket 1 arrives): the publication is not
   committed for it, the daemon stays up, and the next version commits to the survivor
   byte for byte;
3. an aborted publication (the engine fails bucket 1 after loading part of it): the engine is
   left paused and dirty, the retry in the same publication commits, and it holds exactly that
   version.

Writes OUT/colocated_gpu.json; exit 0 when every check holds.
Usage: WPUBD=... WPUB_QUANTIZE_REF=... python3 tests/multi_gpu/colocated_gpu.py OUT_DIR
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
from harness import Daemon, free_port, http_json as get, reference, wait_http  # noqa: E402
from engines_nccl import expect, version_of  # noqa: E402  (the same expectations and model)


def post(url, body):
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def emulator(out, tag, *flags, script="sglang_emulator.py"):
    port = free_port()
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, script),
                          f"--port={port}", "--gpu=0", *flags],
                         stdout=open(os.path.join(out, f"{tag}.log"), "w"),
                         stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 120)
    return p, url


def holds(url, version, ranks, tensors):
    c = post(url + "/check", {"version": version})
    return c, c["checked"] == ranks * tensors and not c["mismatches"]


def three_versions(out):
    res = {"run": "three versions to TP=1 and TP=2 colocated engines", "versions": [], "ok": True}
    a, a_url = emulator(out, "coloc-a", f"--expect-dir={os.path.join(out, 'expect-coloc')}")
    b, b_url = emulator(out, "coloc-b", f"--expect-dir={os.path.join(out, 'expect-coloc')}",
                        "--tp=2")
    d = Daemon(out, "--gpu_path", "--gpu_device=0",
               f"--engines=sglang-ipc+{a_url},sglang-ipc+{b_url}=2", log_level="info",
               timeout=90)
    pub = wpub.Publisher(d.target, timeout=300)
    try:
        for version in (1, 2, 3):
            model, wire = version_of(140 + version)
            ref = reference(out, model)
            expect(out, "coloc", version, ref)
            r = pub.publish(version, wire, bucket_bytes=1 << 20, check=False)
            ca, oka = holds(a_url, version, 1, len(ref))
            cb, okb = holds(b_url, version, 2, len(ref))
            sa, sb = get(a_url + "/stats"), get(b_url + "/stats")
            entry = {"version": version, "status": r.status, "error": r.error_message[:300],
                     "receivers": sorted((o.name, o.committed) for o in r.receivers),
                     "buckets": r.num_buckets, "host_syncs": r.host_syncs,
                     "wall_seconds": r.wall_seconds, "a": ca, "b": cb,
                     "a_calls": {k: sa["calls"].count(k) for k in (
                         "/pause_generation", "/begin_weight_update",
                         "/update_weights_from_tensor", "/end_weight_update",
                         "/continue_generation")},
                     "mixed": [sa["mixed_resumes"], sb["mixed_resumes"]],
                     "sessions_open": [sa["session_open"], sb["session_open"]]}
            ok = (r.committed and len(r.receivers) == 2 and
                  all(o.committed for o in r.receivers) and oka and okb and
                  entry["a_calls"]["/pause_generation"] == version and
                  entry["a_calls"]["/continue_generation"] == version and
                  entry["a_calls"]["/update_weights_from_tensor"] == version * r.num_buckets and
                  entry["mixed"] == [0, 0] and entry["sessions_open"] == [False, False])
            if version > 1:
                ok &= r.host_syncs < r.num_buckets  # no host copy per bucket
            entry["ok"] = ok
            res["ok"] &= ok
            res["versions"].append(entry)
            print(json.dumps(entry), flush=True)
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        log = d.log()
        res["released_late"] = "still hold bucket" in log
        for p in (a, b):
            p.terminate()
            p.wait(10)
    res["ok"] &= res["daemon_exit"] == 0 and not res["released_late"]
    return res


def vllm_and_sglang(out, release):
    """A vLLM engine on its IPC backend (`release`: main takes packing at init, v0.25 per update)
    and an SGLang engine in one publication: three versions, each engine's copy checked."""
    res = {"run": f"vLLM ({release}) and SGLang colocated in one publication", "versions": [],
           "ok": True}
    tag = f"mixed-{release}"
    exp = os.path.join(out, "expect-" + tag)
    v, v_url = emulator(out, tag + "-vllm", f"--expect-dir={exp}", "--backend=ipc",
                        f"--release={release}", script="vllm_emulator.py")
    g, g_url = emulator(out, tag + "-sglang", f"--expect-dir={exp}")
    d = Daemon(out, "--gpu_path", "--gpu_device=0",
               f"--engines=vllm-ipc+{v_url},sglang-ipc+{g_url}", log_level="info", timeout=90)
    pub = wpub.Publisher(d.target, timeout=300)
    try:
        for version in (1, 2, 3):
            model, wire = version_of(180 + version)
            ref = reference(out, model)
            expect(out, tag, version, ref)
            r = pub.publish(version, wire, bucket_bytes=1 << 20, check=False)
            sv = get(v_url + "/stats")
            vv = sv["versions"].get(str(version), {})
            cg, okg = holds(g_url, version, 1, len(ref))
            entry = {"version": version, "status": r.status, "error": r.error_message[:300],
                     "receivers": sorted((o.name, o.committed) for o in r.receivers),
                     "vllm": {"checked": vv.get("checked"), "mismatches": vv.get("mismatches", [])[:5],
                              "mixed": sv["mixed_resumes"]},
                     "sglang": cg, "host_syncs": r.host_syncs, "buckets": r.num_buckets}
            ok = (r.committed and len(r.receivers) == 2 and
                  all(o.committed for o in r.receivers) and okg and
                  vv.get("checked") == len(ref) and not vv.get("mismatches") and
                  sv["mixed_resumes"] == 0)
            entry["ok"] = ok
            res["ok"] &= ok
            res["versions"].append(entry)
            print(json.dumps(entry), flush=True)
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        for p in (v, g):
            p.terminate()
            p.wait(10)
    res["ok"] &= res["daemon_exit"] == 0
    return res


def killed_mid_handover(out):
    res = {"run": "an engine killed mid-handover", "ok": True}
    a, a_url = emulator(out, "kill-a", f"--expect-dir={os.path.join(out, 'expect-kill')}")
    b, b_url = emulator(out, "kill-b", f"--expect-dir={os.path.join(out, 'expect-kill')}",
                        "--die-at-bucket=1")
    d = Daemon(out, "--gpu_path", "--gpu_device=0",
               f"--engines=sglang-ipc+{a_url},sglang-ipc+{b_url}", log_level="info", timeout=90)
    pub = wpub.Publisher(d.target, timeout=300)
    try:
        model, wire = version_of(161)
        expect(out, "kill", 1, reference(out, model))
        r1 = pub.publish(1, wire, bucket_bytes=256 << 10, check=False)
        b.wait(30)
        model, wire = version_of(162)
        ref = reference(out, model)
        expect(out, "kill", 2, ref)
        r2 = pub.publish(2, wire, bucket_bytes=256 << 10, check=False)
        ca, oka = holds(a_url, 2, 1, len(ref))
        res.update({"v1": r1.status, "v1_error": r1.error_message[:300],
                    "v1_receivers": sorted((o.name, o.committed) for o in r1.receivers),
                    "killed_exit": b.returncode, "v2": r2.status, "v2_error": r2.error_message[:300],
                    "v2_receivers": sorted((o.name, o.committed) for o in r2.receivers),
                    "survivor": ca, "daemon_alive": d.proc.poll() is None})
        # v1 never commits for the killed engine; v2 commits to the survivor, byte for byte.
        killed = [c for n, c in res["v1_receivers"] if n == b_url]
        res["ok"] = (killed != [True] and r2.committed and oka and
                     res["daemon_alive"] and b_url not in [n for n, c in res["v2_receivers"] if c])
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        for p in (a, b):
            if p.poll() is None:
                p.terminate()
                p.wait(10)
    res["ok"] &= res["daemon_exit"] == 0
    print(json.dumps(res), flush=True)
    return res


def aborted_then_retried(out):
    res = {"run": "an aborted attempt, the engine dirty, the retry commits", "ok": True}
    a, a_url = emulator(out, "abort-a", f"--expect-dir={os.path.join(out, 'expect-abort')}",
                        "--fail-at-bucket=1")
    d = Daemon(out, "--gpu_path", "--gpu_device=0", f"--engines=sglang-ipc+{a_url}",
               log_level="info", timeout=90)
    pub = wpub.Publisher(d.target, timeout=300)
    try:
        model, wire = version_of(171)
        ref = reference(out, model)
        expect(out, "abort", 1, ref)
        r = pub.publish(1, wire, bucket_bytes=256 << 10, check=False)
        c, ok = holds(a_url, 1, 1, len(ref))
        s = get(a_url + "/stats")
        res.update({"status": r.status, "error": r.error_message[:300],
                    "attempts": r.raw.attempts, "retry_errors": list(r.raw.retry_errors)[:2],
                    "check": c, "held": s["held_versions"], "mixed": s["mixed_resumes"],
                    "resumes": s["calls"].count("/continue_generation"),
                    "begins": s["begins"], "ends": s["ends"], "session_open": s["session_open"]})
        res["ok"] = (r.committed and r.raw.attempts == 2 and ok and s["held_versions"] == ["1"]
                     and s["mixed_resumes"] == 0 and res["resumes"] == 1 and
                     not s["session_open"] and s["begins"] == s["ends"] == 2)
    finally:
        pub.close()
        res["daemon_exit"] = d.stop()
        a.terminate()
        a.wait(10)
    res["ok"] &= res["daemon_exit"] == 0
    print(json.dumps(res), flush=True)
    return res


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/wpub_colocated"
    os.makedirs(out, exist_ok=True)
    results = []
    runs = [three_versions, lambda o: vllm_and_sglang(o, "main"),
            lambda o: vllm_and_sglang(o, "v0.25"), killed_mid_handover, aborted_then_retried]
    for run in runs:
        t0 = time.monotonic()
        try:
            r = run(out)
        except Exception as e:  # a run that raised is a failed run, the others still go
            import traceback
            traceback.print_exc()
            r = {"run": getattr(run, "__name__", "run"), "ok": False, "exception": repr(e)}
        r["seconds"] = round(time.monotonic() - t0, 1)
        results.append(r)
    ok = all(r["ok"] for r in results)
    with open(os.path.join(out, "colocated_gpu.json"), "w") as f:
        json.dump({"ok": ok, "runs": results}, f, indent=1)
    print(json.dumps({"ok": ok, "runs": [(r["run"], r["ok"]) for r in results]}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

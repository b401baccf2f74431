#!/usr/bin/env python3
"""vLLM's rendezvous against a GPU-path wpubd on ONE GPU (what one GPU allows: NCCL needs a GPU
per rank): the vLLM emulator (--handshake-only) is connected as a `vllm+http://` engine; it reads
the pickled ncclUniqueId from the daemon's TCPStore at broadcast_from/0/0 as a vLLM worker does,
unpickles it as vLLM's ctypes ncclUniqueId and answers its init without joining NCCL. The daemon
then waits for the warm-up all-reduce, which never comes, and refuses the group naming it; the
daemon is left with no engines. Also checks the packed chunk decoding of the emulator on the GPU
against vLLM's rule. Exit 0 when every check holds; prints one JSON line of results.

Usage (binaries staged; tests/gpu/run_one_gpu.sh runs it with the wrappers):
    WPUBD=... python3 tests/multi_gpu/vllm_handshake.py OUT_DIR
"""
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
import wpub  # noqa: E402
from harness import Daemon, free_port, http_json as get, wait_http  # noqa: E402



def main():
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    os.makedirs(out, exist_ok=True)
    results, ok = {}, True
    port = free_port()
    emu = subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_emulator.py"),
                            f"--port={port}", "--gpu=0", "--handshake-only"],
                           stdout=open(os.path.join(out, "vllm_emulator.log"), "w"),
                           stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30)
    d = Daemon(out, "--gpu_path", "--gpu_device=0", "--nccl_store_listen=127.0.0.1:0",
               log_level="info", timeout=60)
    pub = wpub.Publisher(d.target, timeout=60)
    try:
        pub.wait_ready()
        t0 = time.monotonic()
        try:
            pub.connect_engines([f"vllm+{url}"], timeout=6)
            results["connect"] = "formed (unexpected: no NCCL peer)"
            ok = False
        except wpub.WpubError as e:
            results["connect"] = f"{type(e).__name__}: {e}"
            ok &= "warm-up" in str(e)
        results["connect_seconds"] = round(time.monotonic() - t0, 2)
        stats = get(url + "/stats")
        results["unique_id_type"] = stats["unique_id_type"]
        results["unique_id_bytes"] = len(bytes.fromhex(stats["unique_id"] or ""))
        results["rank"] = stats["rank"]
        results["calls"] = stats["calls"]
        ok &= stats["unique_id_type"] == \
            "vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId"
        ok &= results["unique_id_bytes"] == 128 and any(bytes.fromhex(stats["unique_id"]))
        ok &= stats["rank"] == 1 and "/init_weight_transfer_engine" in stats["calls"]
        s = pub.status()
        results["engines_after"] = [e.url for e in s.engines if e.state != "left"]
        ok &= not results["engines_after"]
    finally:
        pub.close()
        results["daemon_exit"] = d.stop()
        emu.terminate()
        emu.wait(10)
    # The emulator's packed decoding on the GPU: tensors packed back to back, chunked by vLLM's
    # rule, decoded as vLLM does, equal to what was packed.
    import torch
    sys.path.insert(0, HERE)
    from vllm_emulator import DTYPES, chunks_of  # noqa: E402
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g).float(), torch.randn(64, 16, generator=g).bfloat16(),
               torch.randint(0, 255, (33, 8), generator=g, dtype=torch.uint8)]
    names = ["float32", "bfloat16", "uint8"]
    sizes = [t.numel() * t.element_size() for t in tensors]
    flat = torch.cat([t.contiguous().view(torch.uint8).flatten() for t in tensors]).cuda(0)
    decoded_ok = True
    off = 0
    for first, end, total in chunks_of(sizes, 100):
        chunk = flat[off:off + total]
        o = 0
        for k in range(first, end):
            t = chunk[o:o + sizes[k]].view(DTYPES[names[k]]).view(*tensors[k].shape)
            decoded_ok &= bool(torch.equal(t.cpu(), tensors[k]))
            o += sizes[k]
        off += total
    results["packed_decode_on_gpu"] = decoded_ok
    ok &= decoded_ok and results["daemon_exit"] == 0
    results["ok"] = ok
    print(json.dumps(results))
    with open(os.path.join(out, "vllm_handshake.json"), "w") as f:
        json.dump(results, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

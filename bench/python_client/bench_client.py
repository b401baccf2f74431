#!/usr/bin/env python3
"""Client-side overhead of wpub.Publisher.publish() for the Qwen3-30B-A3B-shaped model
(48 layers, 128 experts of [768, 2048], hidden 2048, 32/4 heads of 128, vocab 151936), with
numpy bf16 inputs sent through POSIX shared memory.

Figures per publication: send = publish() start to the commit message handed to gRPC (every
batch sent); process CPU time (every thread of this process) and calling-thread CPU time over
the call; the baselines measured in the same run are plain numpy copies of the same bytes into
/dev/shm, once into fresh pages and once into the same pages again (what any shm route must pay
at least, cold and warm), and the ratio send / baseline. A Publisher's first publication fills
fresh segments (cold); later ones refill the kept segments (warm: the steady state of an RL run).

The full model is ~61 GB in bf16 and its shm copies must coexist until the report: on a small
machine run scaled-down layer counts (--layers 2,4); the script fits send = a + b * layers over
them and extrapolates to 48 layers, and says so. The daemon publishes with recipe bf16 and no
receivers so its own commit work stays small (it is not what is measured here).

    bench_client.py --wpubd build-py/server/wpubd/wpubd --layers 2,4 --repeats 2 [--json out]
    [--zero_copy: arrays from Publisher.shm_empty, sent by reference]
"""

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
import wpub  # noqa: E402
from wpub.shm import ShmSegment  # noqa: E402

HIDDEN, EXPERTS, MOE_INTER, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB, FULL_LAYERS = (
    2048, 128, 768, 32, 4, 128, 151936, 48)


def layer_arrays(rng):
    """One layer's HF tensors as uint16 bf16 arrays, shared by every layer of the benchmark
    (their bytes are copied into shm per layer exactly as distinct arrays would be)."""
    def a(*shape):
        return rng.integers(0, 0x3F00, size=shape, dtype=np.uint16)
    attn = {
        "q": a(Q_HEADS * HEAD_DIM, HIDDEN), "k": a(KV_HEADS * HEAD_DIM, HIDDEN),
        "v": a(KV_HEADS * HEAD_DIM, HIDDEN), "o": a(HIDDEN, Q_HEADS * HEAD_DIM),
        "qn": a(HEAD_DIM), "kn": a(HEAD_DIM), "ln1": a(HIDDEN), "ln2": a(HIDDEN),
        "router": a(EXPERTS, HIDDEN)}
    experts = [(a(MOE_INTER, HIDDEN), a(MOE_INTER, HIDDEN), a(HIDDEN, MOE_INTER))
                for _ in range(EXPERTS)]
    return attn, experts


def batches(layer_sets, embed, lm_head):
    """layer_sets: one (attn, experts) per layer."""
    T = lambda x: wpub.Tensor(x, dtype="bfloat16")  # noqa: E731
    yield "embedding.word_embeddings.weight", [("model.embed_tokens.weight", T(embed))]
    for L, (attn, experts) in enumerate(layer_sets):
        m, h = f"decoder.layers.{L}", f"model.layers.{L}"
        yield f"{m}.self_attention.linear_qkv.weight", [
            (f"{h}.self_attn.q_proj.weight", T(attn["q"])),
            (f"{h}.self_attn.k_proj.weight", T(attn["k"])),
            (f"{h}.self_attn.v_proj.weight", T(attn["v"]))]
        yield f"{m}.self_attention.linear_proj.weight", [(f"{h}.self_attn.o_proj.weight", T(attn["o"]))]
        yield f"{m}.self_attention.q_layernorm.weight", [(f"{h}.self_attn.q_norm.weight", T(attn["qn"]))]
        yield f"{m}.self_attention.k_layernorm.weight", [(f"{h}.self_attn.k_norm.weight", T(attn["kn"]))]
        yield f"{m}.input_layernorm.weight", [(f"{h}.input_layernorm.weight", T(attn["ln1"]))]
        yield f"{m}.pre_mlp_layernorm.weight", [(f"{h}.post_attention_layernorm.weight", T(attn["ln2"]))]
        yield f"{m}.mlp.router.weight", [(f"{h}.mlp.gate.weight", T(attn["router"]))]
        for e, (g, u, d) in enumerate(experts):
            yield f"{m}.mlp.experts.linear_fc1.weight{e}", [
                (f"{h}.mlp.experts.{e}.gate_proj.weight", T(g)),
                (f"{h}.mlp.experts.{e}.up_proj.weight", T(u))]
            yield f"{m}.mlp.experts.linear_fc2.weight{e}", [(f"{h}.mlp.experts.{e}.down_proj.weight", T(d))]
    yield "decoder.final_layernorm.weight", [("model.norm.weight", T(attn["ln1"]))]
    yield "output_layer.weight", [("lm_head.weight", T(lm_head))]


def model_bytes(layers, attn, experts, embed, lm_head):
    per_layer = sum(x.nbytes for x in attn.values()) + sum(x.nbytes for t in experts for x in t)
    return embed.nbytes + lm_head.nbytes + attn["ln1"].nbytes + layers * per_layer


def memcpy_baseline(arrays):
    """(fresh, warm): seconds to copy `arrays` into new shm segments (page faults included),
    then again into the same, already faulted-in segments: the floors of the cold and warm shm
    routes for host arrays."""
    segs = [ShmSegment(f"wpub-bench-{os.getpid()}-{i}", x.nbytes) for i, x in enumerate(arrays)]
    try:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            for s, x in zip(segs, arrays):
                s.write(0, x)
            times.append(time.perf_counter() - t0)
    finally:
        for s in segs:
            s.close()
    return times[0], times[1]


def start_daemon(path, workdir):
    ready = os.path.join(workdir, "ready.json")
    log = open(os.path.join(workdir, "wpubd.log"), "ab")
    proc = subprocess.Popen([path, "--listen=127.0.0.1:0", "--metrics_listen=",
                             f"--ready_file={ready}", "--log_level=warn",
                             "--commit_deadline=600s"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"wpubd did not start (see {workdir}/wpubd.log)")
        time.sleep(0.05)
    time.sleep(0.05)
    with open(ready) as f:
        return proc, f"127.0.0.1:{json.load(f)['grpc_port']}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--wpubd", default=os.environ.get("WPUBD", ""))
    ap.add_argument("--target", default="", help="use a running wpubd instead of --wpubd")
    ap.add_argument("--layers", default="2,4", help="comma-separated layer counts to run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--zero_copy", action="store_true",
                    help="arrays allocated by Publisher.shm_empty (one set per layer, filled "
                         "before the timed publications): sent by reference, not copied")
    ap.add_argument("--structure_only", action="store_true",
                    help="every tensor [16, 16] and inline: the per-batch cost of the client "
                         "without payload copies (same names, batches and messages)")
    args = ap.parse_args()
    layer_counts = [int(x) for x in args.layers.split(",")]

    rng = np.random.default_rng(0)
    attn, experts = layer_arrays(rng)
    embed = rng.integers(0, 0x3F00, size=(VOCAB, HIDDEN), dtype=np.uint16)
    lm_head = rng.integers(0, 0x3F00, size=(VOCAB, HIDDEN), dtype=np.uint16)
    if args.structure_only:
        tiny = lambda: rng.integers(0, 0x3F00, size=(16, 16), dtype=np.uint16)  # noqa: E731
        attn = {k: tiny() for k in attn}
        experts = [(tiny(), tiny(), tiny()) for _ in experts]
        embed, lm_head = tiny(), tiny()

    workdir = tempfile.mkdtemp(prefix="wpub-bench-py-")
    proc = None
    target = args.target
    if not target:
        if not args.wpubd:
            raise SystemExit("pass --wpubd (or --target, or set WPUBD)")
        proc, target = start_daemon(args.wpubd, workdir)
    probe = wpub.Publisher(target)
    probe.wait_ready()
    version = probe.status().committed_version
    probe.close()
    rows = []
    pub = None
    try:
        for layers in layer_counts:
            # A fresh Publisher per model size: its first publication fills fresh shm pages
            # (cold), the next ones refill the kept segments (warm, the steady state of training).
            pub = wpub.Publisher(target, timeout=3600, shm_threshold_bytes=1 << 20)
            if args.zero_copy:
                def in_shm(x):
                    y = pub.shm_empty(x.shape, x.dtype)
                    y[...] = x
                    return y
                layer_sets = [({k: in_shm(v) for k, v in attn.items()},
                               [tuple(in_shm(x) for x in t) for t in experts])
                              for _ in range(layers)]
                ends = (in_shm(embed), in_shm(lm_head))
            else:
                layer_sets = [(attn, experts)] * layers
                ends = (embed, lm_head)
            nbytes = model_bytes(layers, attn, experts, embed, lm_head)
            arrays = [embed, lm_head] + list(attn.values()) * layers + \
                [x for t in experts for x in t] * layers
            base_cold, base_warm = memcpy_baseline(arrays)
            del arrays
            for r in range(args.repeats):
                version += 1
                gc.collect()
                report = pub.publish(version, batches(layer_sets, *ends),
                                     recipe="bf16", model_id="qwen3-30b-a3b-shaped")
                c = report.client
                base = base_cold if r == 0 else base_warm
                rows.append({
                    "layers": layers, "repeat": r, "shm": "cold" if r == 0 else "warm",
                    "model_bytes": nbytes,
                    "batches": c.batches, "tensors": c.tensors, "messages": c.messages,
                    "shm_bytes": c.shm_bytes, "inline_bytes": c.inline_bytes,
                    "shm_zero_copy_bytes": c.shm_zero_copy_bytes,
                    "send_s": c.send_seconds, "total_s": c.total_seconds,
                    "process_cpu_s": c.cpu_seconds, "caller_cpu_s": c.caller_cpu_seconds,
                    "memcpy_baseline_s": base, "ratio_vs_memcpy": c.send_seconds / base,
                    "send_gbps": nbytes / c.send_seconds / 1e9, "daemon_wall_s": report.wall_seconds})
                print(f"layers={layers} rep={r} ({rows[-1]['shm']} shm): {nbytes / 1e9:.2f} GB, "
                      f"{c.batches} batches, "
                      f"send {c.send_seconds:.3f}s ({nbytes / c.send_seconds / 1e9:.2f} GB/s), "
                      f"CPU {c.cpu_seconds:.3f}s (caller {c.caller_cpu_seconds:.3f}s), "
                      f"{rows[-1]['shm']} memcpy baseline {base:.3f}s, "
                      f"ratio {c.send_seconds / base:.2f}, "
                      f"daemon wall {report.wall_seconds:.2f}s", flush=True)
            pub.close()
            pub = None
            layer_sets = ends = None
    finally:
        if pub is not None:
            pub.close()
        if proc is not None:
            proc.terminate()
            proc.wait(60)

    # Linear fit over the layer counts (best repeat of each) and extrapolation to 48 layers.
    fit = {"model_bytes_48": model_bytes(FULL_LAYERS, attn, experts, embed, lm_head)}
    for kind in ("cold", "warm"):
        best = {}
        for row in rows:
            b = best.get(row["layers"])
            if row["shm"] == kind and (b is None or row["send_s"] < b["send_s"]):
                best[row["layers"]] = row
        if len(best) < 2:
            continue
        xs = np.array(sorted(best), dtype=float)
        fit[kind] = {}
        for key in ("send_s", "process_cpu_s", "caller_cpu_s", "memcpy_baseline_s"):
            ys = np.array([best[int(x)][key] for x in xs])
            slope, icpt = np.polyfit(xs, ys, 1)
            fit[kind][key] = {"per_layer": slope, "fixed": icpt,
                              "at_48_layers": icpt + slope * FULL_LAYERS}
        f = fit[kind]
        print(f"{kind} shm, extrapolated to {FULL_LAYERS} layers "
              f"({fit['model_bytes_48'] / 1e9:.1f} GB): send {f['send_s']['at_48_layers']:.2f}s, "
              f"process CPU {f['process_cpu_s']['at_48_layers']:.2f}s, "
              f"caller CPU {f['caller_cpu_s']['at_48_layers']:.2f}s, "
              f"{kind} memcpy baseline {f['memcpy_baseline_s']['at_48_layers']:.2f}s")
    out = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs",
           "python": sys.version.split()[0], "rows": rows, "fit": fit}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

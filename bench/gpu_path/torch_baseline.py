#!/usr/bin/env python3
"""Benchmark case (c): the PyTorch baseline wpub replaces.

What the trainer-side publisher did before wpub: per routed-expert weight, NVFP4 quantization with
torch ops (global amax read back to the host with .item(), the global scale computed on the host,
block scales and E2M1 codes with elementwise torch ops, nibble packing), then one
torch.distributed broadcast per published tensor (packed codes, block scales, weight_scale_2, and
every BF16 attention/norm tensor). Two processes: rank 0 on GPU 0 publishes, rank 1 on GPU 1
receives into tensors of the announced shapes. Same synthetic Qwen3-30B-A3B shape as
gpu_path_bench (48 layers, 128 experts [768, 2048], hidden 2048).

--max_seconds bounds the run: when the publication is not finished by then, the measured layers
are extrapolated linearly to the full model (reported as such).
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

E2M1_BOUNDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def layer_tensors(a, l):
    p = f"model.layers.{l}."
    h, hd = a.hidden, a.head_dim
    out = [
        (p + "input_layernorm.weight", (h,), False),
        (p + "self_attn.q_proj.weight", (a.heads * hd, h), False),
        (p + "self_attn.k_proj.weight", (a.kv_heads * hd, h), False),
        (p + "self_attn.v_proj.weight", (a.kv_heads * hd, h), False),
        (p + "self_attn.o_proj.weight", (h, a.heads * hd), False),
        (p + "self_attn.q_norm.weight", (hd,), False),
        (p + "self_attn.k_norm.weight", (hd,), False),
        (p + "post_attention_layernorm.weight", (h,), False),
        (p + "mlp.gate.weight", (a.experts, h), False),
    ]
    for e in range(a.experts):
        x = f"{p}mlp.experts.{e}."
        out += [(x + "gate_proj.weight", (a.inter, h), True),
                (x + "up_proj.weight", (a.inter, h), True),
                (x + "down_proj.weight", (h, a.inter), True)]
    return out


def quantize_nvfp4(w, amax):
    """Standard NVFP4 (E = 448) with torch ops; `amax` is a host float (already synced)."""
    s_enc = min(448.0 * 6.0 / amax, 3.4028234663852886e38) if amax > 0 else 3.4028234663852886e38
    s_dec = 1.0 / s_enc
    m, k = w.shape
    x = w.float().reshape(m, k // 16, 16)
    bmax = x.abs().amax(dim=-1)
    sf = (bmax * (s_enc / 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn)
    inv = (1.0 / (sf.float() * s_dec)).clamp(max=3.4028234663852886e38)
    y = x * inv.unsqueeze(-1)
    bounds = torch.tensor(E2M1_BOUNDS, device=w.device)
    code = torch.bucketize(y.abs(), bounds).to(torch.uint8)
    code = code | ((y < 0).to(torch.uint8) << 3)
    code = code.reshape(m, k)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), sf.view(torch.uint8).contiguous(), torch.tensor(
        s_dec, dtype=torch.float32, device=w.device)


def run(rank, a, result_path):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=2, device_id=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(2026)
    # Rank 0 owns the model (generated once, outside the timed region).
    model = []
    for l in range(a.layers):
        for name, shape, quant in layer_tensors(a, l):
            t = None
            if rank == 0:
                t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * 0.02
                     ).to(torch.bfloat16)
            model.append((name, shape, quant, t))
    torch.cuda.synchronize()
    dist.barrier()
    host_syncs = 0
    broadcasts = 0
    nbytes = 0
    t0 = time.perf_counter()
    layers_done = 0
    i = 0
    per_layer = len(layer_tensors(a, 0))
    while i < len(model):
        name, shape, quant, t = model[i]
        if quant and name.endswith("gate_proj.weight"):
            group = [model[i], model[i + 1]]  # gate/up share one amax
            step = 2
        else:
            group = [model[i]]
            step = 1
        if quant:
            amax = 0.0
            if rank == 0:
                amax = max(g[3].abs().max().float().item() for g in group)  # host syncs
                host_syncs += len(group)
            for g in group:
                m, k = g[1]
                if rank == 0:
                    outs = quantize_nvfp4(g[3], amax)
                else:
                    outs = (torch.empty((m, k // 2), dtype=torch.uint8, device=dev),
                            torch.empty((m, k // 16), dtype=torch.uint8, device=dev),
                            torch.empty((), dtype=torch.float32, device=dev))
                for o in outs:
                    dist.broadcast(o, src=0)
                    broadcasts += 1
                    nbytes += o.numel() * o.element_size()
        else:
            buf = t if rank == 0 else torch.empty(shape, dtype=torch.bfloat16, device=dev)
            dist.broadcast(buf, src=0)
            broadcasts += 1
            nbytes += buf.numel() * 2
        i += step
        if i % per_layer == 0:
            layers_done += 1
            # Both ranks decide together whether to stop (a tiny broadcast, not timed apart).
            stop = torch.tensor([1 if time.perf_counter() - t0 > a.max_seconds else 0],
                                device=dev)
            dist.broadcast(stop, src=0)
            if stop.item() and layers_done < a.layers:
                break
    torch.cuda.synchronize()
    host_syncs += 1
    wall = time.perf_counter() - t0
    if rank == 0:
        scale = a.layers / layers_done
        res = {"case": "(c) torch per-expert baseline", "layers_measured": layers_done,
               "layers": a.layers, "wall_seconds_measured": wall,
               "wall_seconds": wall * scale, "extrapolated": layers_done < a.layers,
               "broadcasts": int(broadcasts * scale), "bytes": int(nbytes * scale),
               "host_syncs": int(host_syncs * scale), "gbps": nbytes / wall / 1e9}
        print(json.dumps(res, indent=1), flush=True)
        with open(result_path, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--max_seconds", type=float, default=120)
    p.add_argument("--json", default="torch_baseline.json")
    a = p.parse_args()
    mp.spawn(run, args=(a, a.json), nprocs=2, join=True)


if __name__ == "__main__":
    main()

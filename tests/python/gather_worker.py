#!/usr/bin/env python3
"""One rank of test_local_gather: holds its shards of the test model (TP 2: column-parallel
tensors split along dim 0, row-parallel along dim 1, norms and routers replicated; experts
split EP-wise: rank r holds the experts e with e % 2 == r), shares them with
wpub.torch.LocalGather over gloo, and rank 0 publishes the whole model.

    gather_worker.py RANK WORLD RDZV_FILE TARGET VERSION SEED DEVICE RESULT_JSON [LAYOUT]
DEVICE: "cpu" (shared-memory references) or "cuda" (CUDA IPC references, one GPU for both
ranks). LAYOUT "tp" (default: the shards above, tp_dim by name) or "fsdp2": every tensor a
DTensor on a 1-D CPU mesh of the WORLD ranks, sharded along dim 0 as FSDP2 shards parameters
(uneven shards when a dimension does not divide; the routers Replicate), handed to LocalGather
as they are. LAYOUT "bad": rank 1 passes a wpub.concat (one tensor per name is what a rank may
share): share() must raise TensorError on EVERY rank (none left waiting in the collective);
each rank prints it and exits 4. Rank 0 writes RESULT_JSON; every rank exits 0 when its
release() saw a commit."""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import qwen3_batches  # noqa: E402

import wpub  # noqa: E402
import wpub.torch as wt  # noqa: E402


def shards(rank, world, seed, device):
    """This rank's conversion batches: its shards of qwen3_batches(seed)."""
    out = []
    for m, ts in qwen3_batches(seed=seed):
        mine = []
        for n, a in ts:
            if ".mlp.experts." in n:
                e = int(n.split(".mlp.experts.")[1].split(".")[0])
                if e % world != rank:
                    continue
                part = a
            else:
                dim = wt.hf_tp_dim(n)
                part = a if dim is None else np.array_split(a, world, axis=dim)[rank]
            t = torch.from_numpy(np.ascontiguousarray(part).astype(np.int16)).view(torch.bfloat16)
            mine.append((n, t.to(device) if device != "cpu" else t))
        if mine:
            out.append((m, mine))
    return out


def fsdp2_params(world, seed):
    """Every tensor of qwen3_batches(seed) as FSDP2 holds it: a DTensor sharded along dim 0
    over a 1-D mesh of the world (the routers replicated, for the other placement)."""
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.0-2.3
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for m, ts in qwen3_batches(seed=seed):
        mine = []
        for n, a in ts:
            t = torch.from_numpy(np.ascontiguousarray(a).astype(np.int16)).view(torch.bfloat16)
            placement = Replicate() if n.endswith(".mlp.gate.weight") else Shard(0)
            mine.append((n, distribute_tensor(t, mesh, [placement])))
        out.append((m, mine))
    return out


def main():
    rank, world, rdzv, target, version, seed, device, result = sys.argv[1:9]
    layout = sys.argv[9] if len(sys.argv) > 9 else "tp"
    rank, world, version, seed = int(rank), int(world), int(version), int(seed)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    gather = wt.LocalGather()
    mine = fsdp2_params(world, seed) if layout == "fsdp2" else shards(rank, world, seed, device)
    if layout == "fsdp2" and rank == 0:
        # This rank alone holds a shard: publishing it directly is refused, naming the way.
        name, t = mine[-1][1][-1]
        try:
            wpub.tensors.normalize(name, t)
            info_refused = ""
        except wpub.TensorError as e:
            info_refused = str(e)
    if layout == "bad":
        if rank == 1:
            name, t = mine[0][1][0]
            mine[0][1][0] = (name, wpub.concat([t], 0))
        try:
            gather.share(mine)
        except wpub.TensorError as e:
            print(f"REFUSED: {e.message}", flush=True)
            gather.close()
            dist.destroy_process_group()
            sys.exit(4)
        sys.exit(5)
    batches = gather.share(mine)
    outcome = None
    info = {}
    if gather.is_publisher:
        pub = wpub.Publisher(target, timeout=120)
        try:
            outcome = pub.publish(version, batches)
            c = outcome.client
            info = {"committed": outcome.committed, "shm_zero_copy_bytes": c.shm_zero_copy_bytes,
                    "cuda_ipc_bytes": c.cuda_ipc_bytes, "bytes_in": outcome.bytes_in,
                    "quantized": outcome.tensors_quantized}
        except wpub.WpubError as e:
            outcome = e
            info = {"committed": False, "error": str(e), "code": getattr(e.code, "name", "")}
        pub.close()
    summary = gather.release(outcome)
    gather.close()
    dist.destroy_process_group()
    if gather.is_publisher:
        info["summary"] = summary
        if layout == "fsdp2":
            info["direct_refusal"] = info_refused
        with open(result, "w") as f:
            json.dump(info, f)
    sys.exit(0 if summary["committed"] or "error" in info else 3)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Several ranks per node: every rank holds its tensor-parallel shards, one rank publishes the
whole model. wpub.torch.LocalGather hands the other ranks' shards to the publishing rank over
the trainer's own torch.distributed as references (CUDA IPC handles on GPUs, shared-memory
segments on the CPU): no weight is copied between ranks and nothing is all-gathered; wpubd
reads every shard in place and assembles the TP tensors (wpub.concat).

    cmake --install build --prefix ~/.local   # once: wpubd, wpub-recv on PATH (~/.local/bin)
    wpubd &  wpub-recv --output=/tmp/engine.safetensors &
    PYTHONPATH=clients/python python3 examples/torch_ranks_per_node.py --ranks=2 --steps=2

Here the ranks are spawned with torch.multiprocessing and a gloo group on the CPU; in a trainer
they are the job's own ranks (a group of the ranks of one model copy on this node, in TP rank
order; with NCCL, set each rank's CUDA device first). Needs torch."""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import wpub
import wpub.torch

HIDDEN, INTER, EXPERTS = 256, 128, 4


def full_model(step: int):
    """The unsharded weights of one layer (HF names), the same on every rank for `step`."""
    g = torch.Generator().manual_seed(step)
    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    h = "model.layers.0"
    m = {f"{h}.self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
         f"{h}.self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
         f"{h}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
         f"{h}.mlp.gate.weight": w(EXPERTS, HIDDEN)}
    for e in range(EXPERTS):
        for n, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                         ("down_proj", (HIDDEN, INTER))):
            m[f"{h}.mlp.experts.{e}.{n}.weight"] = w(*shape)
    return m


def my_shards(model, rank: int, ranks: int):
    """This rank's TP shards: column-parallel split along dim 0, row-parallel along dim 1
    (wpub.torch.hf_tp_dim), replicated tensors whole."""
    out = {}
    for name, t in model.items():
        dim = wpub.torch.hf_tp_dim(name)
        out[name] = t if dim is None else t.chunk(ranks, dim)[rank].contiguous()
    return out


def rank_main(rank: int, ranks: int, rdzv: str, target: str, steps: int):
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=ranks)
    gather = wpub.torch.LocalGather()            # the default group; rank 0 publishes
    pub = wpub.Publisher(target) if gather.is_publisher else None
    start = pub.status().committed_version + 1 if pub else 0
    objs = [start]
    dist.broadcast_object_list(objs, src=0)
    for step in range(objs[0], objs[0] + steps):
        shards = my_shards(full_model(step), rank, ranks)
        batches = gather.share(wpub.torch.conversion_batches(shards))   # every rank
        outcome = None
        if gather.is_publisher:
            try:
                outcome = pub.publish(step, batches, recipe="nvfp4", model_id="toy-tp")
            except wpub.WpubError as e:
                outcome = e
        summary = gather.release(outcome)   # every rank: from here on shards may change
        if rank == 0:
            print(f"step {step}: {summary['status']}"
                  + (f" ({outcome.summary()})" if summary["committed"] else
                     f": {summary['error']}"), flush=True)
    gather.close()
    if pub:
        pub.close()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=os.environ.get("WPUB_TARGET", "127.0.0.1:50151"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(args.ranks, os.path.join(tmp, "rdzv"), args.target,
                                  args.steps), nprocs=args.ranks)


if __name__ == "__main__":
    main()

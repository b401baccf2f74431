#!/usr/bin/env python3
"""A publication group: one sidecar (wpubd) per training node, one version. Each rank stands for
a node (or a pipeline stage) holding some layers of the model; it publishes them to its own
node's daemon, the daemons agree on the version among themselves (rank 0's daemon leads), and
rank 0 learns the outcome of every member through torch.distributed.

    cmake --install build --prefix ~/.local   # once: wpubd, wpub-recv on PATH (~/.local/bin)
    wpubd --listen=127.0.0.1:50151 --metrics_listen= &
    wpubd --listen=127.0.0.1:50152 --metrics_listen= &
    wpub-recv --target=127.0.0.1:50151,127.0.0.1:50152 --output=/tmp/engine.safetensors &
    PYTHONPATH=clients/python python3 examples/publication_group.py \
        --targets=127.0.0.1:50151,127.0.0.1:50152 --steps=2

The ranks are spawned here with torch.multiprocessing and a gloo group on the CPU; in a trainer
they are the job's publishing ranks (one per node, e.g. local rank 0 after a
wpub.torch.LocalGather), in a process group of their own. Needs torch."""

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import wpub

HIDDEN, INTER, EXPERTS, LAYERS = 128, 64, 4, 4


def model(step: int):
    """Every tensor of the model (HF names) as (megatron name, [(hf name, tensor)]) batches."""
    g = torch.Generator().manual_seed(step)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    out = [("embedding.word_embeddings.weight", [("model.embed_tokens.weight", w(256, HIDDEN))])]
    for L in range(LAYERS):
        m, h = f"decoder.layers.{L}", f"model.layers.{L}"
        out.append((f"{m}.self_attention.linear_proj.weight",
                    [(f"{h}.self_attn.o_proj.weight", w(HIDDEN, HIDDEN))]))
        out.append((f"{m}.mlp.router.weight", [(f"{h}.mlp.gate.weight", w(EXPERTS, HIDDEN))]))
        for e in range(EXPERTS):
            out.append((f"{m}.mlp.experts.linear_fc1.weight{e}", [
                (f"{h}.mlp.experts.{e}.gate_proj.weight", w(INTER, HIDDEN)),
                (f"{h}.mlp.experts.{e}.up_proj.weight", w(INTER, HIDDEN))]))
            out.append((f"{m}.mlp.experts.linear_fc2.weight{e}",
                        [(f"{h}.mlp.experts.{e}.down_proj.weight", w(HIDDEN, INTER))]))
    out.append(("decoder.final_layernorm.weight",
                [("model.norm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16))]))
    return out


def my_stage(batches, rank: int, ranks: int):
    """The batches a pipeline stage holds: layers split into contiguous stages (embeddings with
    the first, the final norm with the last)."""
    def stage_of(megatron: str) -> int:
        if megatron.startswith("embedding."):
            return 0
        if megatron.startswith("decoder.layers."):
            return int(megatron.split(".")[2]) * ranks // LAYERS
        return ranks - 1
    return [b for b in batches if stage_of(b[0]) == rank]


def rank_main(rank: int, ranks: int, rdzv: str, targets, steps: int, result: str):
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=ranks)
    pub = wpub.Publisher(targets[rank], timeout=60)
    pub.wait_ready()
    # Each rank's daemon; rank 0's daemon leads. Collective.
    group = wpub.PublicationGroup.from_torch(pub, "example", leader=targets[0])
    start = pub.status().committed_version
    versions = [None] * ranks
    dist.all_gather_object(versions, start)
    start = max(versions) + 1
    outcomes = []
    for step in range(start, start + steps):
        batches = model(step)
        names = [n for _, ts in batches for n, _ in ts]
        outcome = group.publish(step, my_stage(batches, rank, ranks),
                                expected_tensors=names if rank == 0 else None)
        if rank == 0:
            print(f"v{step}: {'committed' if outcome.committed else 'NOT committed'} "
                  f"{[(r['member'], r['status'], round(r['wall_seconds'], 3)) for r in outcome.reports]}"
                  f"{' ' + outcome.error if outcome.error else ''}")
            outcomes.append({"version": step, "committed": outcome.committed,
                             "reports": outcome.reports, "tensors": len(names)})
    if rank == 0 and result:
        with open(result, "w") as f:
            json.dump(outcomes, f)
    pub.close()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="127.0.0.1:50151,127.0.0.1:50152",
                   help="every node's wpubd, in member order (rank i publishes to targets[i])")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--result", default="", help="rank 0 writes the outcomes here as JSON")
    args = p.parse_args()
    targets = args.targets.split(",")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(len(targets), os.path.join(d, "rdzv"), targets, args.steps,
                                  args.result), nprocs=len(targets), join=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""An RL training loop's weight-publication step with wpub: a toy Qwen3-MoE-shaped model held
under Megatron parameter names, a small Megatron->HF converter (fused QKV split into q/k/v,
fused expert fc1 split into gate/up), and one publish() per step.

    cmake --install build --prefix ~/.local   # once: wpubd, wpub-recv on PATH (~/.local/bin)
    wpubd &                         # the sidecar (CPU backend is enough for this example)
    wpub-recv --output=/tmp/engine.safetensors &
    PYTHONPATH=clients/python python3 examples/rl_step.py --target=127.0.0.1:50151 --steps=3

Uses torch when installed (tensors on the GPU when one is there: published by CUDA IPC), numpy
otherwise (bf16 as uint16 arrays wrapped in wpub.Tensor)."""

import argparse
import time

import numpy as np

import wpub

try:
    import torch
except ImportError:
    torch = None

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, MOE_INTER, LAYERS = 256, 4, 2, 64, 8, 128, 2


def init_megatron_state(rng):
    """Megatron-named fp32 master weights (what a trainer's optimizer updates)."""
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    s = {}
    for L in range(LAYERS):
        p = f"decoder.layers.{L}"
        s[f"{p}.self_attention.linear_qkv.weight"] = rng.standard_normal((qkv_rows, HIDDEN))
        s[f"{p}.self_attention.linear_proj.weight"] = rng.standard_normal((HIDDEN, HEADS * HEAD_DIM))
        s[f"{p}.input_layernorm.weight"] = np.ones(HIDDEN)
        s[f"{p}.pre_mlp_layernorm.weight"] = np.ones(HIDDEN)
        s[f"{p}.mlp.router.weight"] = rng.standard_normal((EXPERTS, HIDDEN))
        for e in range(EXPERTS):
            # Megatron's grouped-GEMM experts: fc1 holds [gate; up] fused along rows.
            s[f"{p}.mlp.experts.linear_fc1.weight{e}"] = rng.standard_normal((2 * MOE_INTER, HIDDEN))
            s[f"{p}.mlp.experts.linear_fc2.weight{e}"] = rng.standard_normal((HIDDEN, MOE_INTER))
    return {k: (v * 0.02).astype(np.float32) for k, v in s.items()}


def to_publishable(x: np.ndarray):
    """fp32 master weight -> bf16 tensor in the form wpub takes (torch bf16, or uint16+dtype)."""
    if torch is not None:
        t = torch.from_numpy(x).to(torch.bfloat16)
        return t.cuda() if torch.cuda.is_available() else t
    u = x.astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
    return wpub.Tensor(u.astype(np.uint16), dtype="bfloat16")


def megatron_to_hf(name: str, w: np.ndarray):
    """One Megatron parameter -> [(hf_name, tensor), ...] (the trainer's model converter)."""
    parts = name.split(".")
    L = parts[2]
    h = f"model.layers.{L}"
    if name.endswith("linear_qkv.weight"):
        q, k, v = np.split(w, [HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM])
        return [(f"{h}.self_attn.q_proj.weight", q), (f"{h}.self_attn.k_proj.weight", k),
                (f"{h}.self_attn.v_proj.weight", v)]
    if name.endswith("linear_proj.weight"):
        return [(f"{h}.self_attn.o_proj.weight", w)]
    if name.endswith("input_layernorm.weight"):
        return [(f"{h}.input_layernorm.weight", w)]
    if name.endswith("pre_mlp_layernorm.weight"):
        return [(f"{h}.post_attention_layernorm.weight", w)]
    if name.endswith("router.weight"):
        return [(f"{h}.mlp.gate.weight", w)]
    if ".linear_fc1.weight" in name:
        e = name.rsplit("weight", 1)[1]
        gate, up = np.split(w, 2)
        return [(f"{h}.mlp.experts.{e}.gate_proj.weight", gate),
                (f"{h}.mlp.experts.{e}.up_proj.weight", up)]
    if ".linear_fc2.weight" in name:
        e = name.rsplit("weight", 1)[1]
        return [(f"{h}.mlp.experts.{e}.down_proj.weight", w)]
    raise KeyError(f"no HF mapping for {name}")


def conversion_batches(state):
    """Yields one batch per Megatron parameter, converted lazily: wpub streams each batch as
    soon as it is produced, so conversion overlaps the daemon's ingestion."""
    for name, w in state.items():
        yield name, [(hf, to_publishable(np.ascontiguousarray(t))) for hf, t in megatron_to_hf(name, w)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="127.0.0.1:50151")
    ap.add_argument("--token", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recipe", default="nvfp4")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    state = init_megatron_state(rng)
    pub = wpub.Publisher(args.target, token=args.token, timeout=300)
    pub.wait_ready()
    start = pub.status().committed_version + 1
    for step in range(start, start + args.steps):
        # --- the RL step: rollouts, loss, backward, optimizer (here: a random update) ---
        for w in state.values():
            w += rng.standard_normal(w.shape, dtype=np.float32) * 1e-3
        # --- publish the new policy weights to the rollout engines ---
        t0 = time.perf_counter()
        try:
            report = pub.publish(step, conversion_batches(state), recipe=args.recipe,
                                 model_id="toy-qwen3-moe",
                                 policy={"first_last_layers_bf16": False})
        except wpub.PublicationAborted as e:  # an engine failed: it keeps the previous version
            print(f"step {step}: not published: {e.message}")
            continue
        except wpub.InvalidArgument as e:  # a converter bug: the message names the tensor
            raise SystemExit(f"step {step}: rejected: {e.message}")
        print(f"step {step}: {report.summary()} [{time.perf_counter() - t0:.3f}s]")
    pub.close()


if __name__ == "__main__":
    main()

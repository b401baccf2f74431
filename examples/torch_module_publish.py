#!/usr/bin/env python3
"""Publishing a torch model that has HF names (an FSDP / plain-HF trainer) with wpub.torch,
asynchronously: the next step's rollouts and backward run while the publication is in flight.

    cmake --install build --prefix ~/.local   # once: wpubd, wpub-recv on PATH (~/.local/bin)
    wpubd &                            # the sidecar (CPU backend is enough for this example)
    wpub-recv --output=/tmp/engine.safetensors &
    PYTHONPATH=clients/python python3 examples/torch_module_publish.py --steps=3
    # in a pod: WPUB_TARGET and WPUB_TOKEN_FILE come from the manifest (Publisher.from_env)

The routed experts (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight) are quantized to
NVFP4 by their HF names; attention, norms and the router pass in bf16. Needs torch."""

import argparse
import logging

import torch

import wpub
import wpub.torch

HIDDEN, INTER, EXPERTS, LAYERS = 256, 128, 8, 2


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = torch.nn.Linear(INTER, HIDDEN, bias=False)


class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.ModuleDict({n: torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
                                              for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.mlp = torch.nn.Module()
        self.mlp.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)      # the router
        self.mlp.experts = torch.nn.ModuleList([Expert() for _ in range(EXPERTS)])
        self.input_layernorm = RMSNorm()


class ToyMoe(torch.nn.Module):
    """A Qwen3-MoE-shaped toy with HF parameter names: model.layers.N...."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([Layer() for _ in range(LAYERS)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="default: $WPUB_TARGET or 127.0.0.1:50151")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="show wpub's log (INFO)")
    args = ap.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    torch.manual_seed(0)
    model = ToyMoe().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    pub = wpub.Publisher.from_env(**({"target": args.target} if args.target else {}))
    pub.wait_ready()
    start = pub.status().committed_version + 1
    pending = None
    for step in range(start, start + args.steps):
        # --- rollouts and backward: read the weights, do not change them ---
        x = torch.randn(4, HIDDEN, dtype=torch.bfloat16)
        loss = sum(layer.self_attn["q_proj"](x).float().square().mean()
                   for layer in model.model.layers)
        opt.zero_grad()
        loss.backward()
        # --- the previous publication must be done with the weights before they change ---
        if pending is not None:
            pending.released.wait()      # host tensors: pending.sent would do; CUDA: released
            report = pending.result()
            print(f"step {pending.version}: {report.summary()}")
        opt.step()
        # --- publish this step's weights while the next step runs ---
        pending = wpub.torch.publish_async(pub, step, model, recipe="nvfp4",
                                           model_id="toy-hf-moe")
    if pending is not None:
        try:
            print(f"step {pending.version}: {pending.result().summary()}")
        except wpub.PublicationAborted as e:  # an engine failed: it keeps the previous version
            print(f"step {pending.version}: not published: {e.message}")
    pub.close()


if __name__ == "__main__":
    main()

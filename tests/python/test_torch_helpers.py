"""wpub.torch: an HF-named torch module (as FSDP/HF trainers hold it) published through a real
wpubd with recipe nvfp4 -- its routed experts must be quantized, bit-exact against the
reference -- conversion batches that keep gate/up pairs together, Megatron per-expert names,
and publish_async of a module. Skips without torch (Debian 12: apt-get install python3-torch)."""

import unittest

import numpy as np

from harness import DaemonTestCase, bf16, reference

import wpub

try:
    import torch
    import wpub.torch as wt
except ImportError:
    torch = wt = None

HIDDEN, INTER, EXPERTS = 64, 32, 4


def _bits(t) -> np.ndarray:
    """A bf16 torch tensor's bits as uint16 (what the reference tool takes)."""
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


if torch is not None:
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(HIDDEN))

    class Expert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
            self.up_proj = torch.nn.Linear(HIDDEN, INTER, bias=False)
            self.down_proj = torch.nn.Linear(INTER, HIDDEN, bias=False)

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
            self.experts = torch.nn.ModuleList([Expert() for _ in range(EXPERTS)])

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
            self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = Norm()
            self.self_attn = Attention()
            self.mlp = Moe()

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])
            self.norm = Norm()

    class HfMoe(torch.nn.Module):
        """model.layers.0.mlp.experts.E.{gate,up,down}_proj.weight, as HF Qwen3-MoE names."""
        def __init__(self, seed: int):
            super().__init__()
            self.model = Body()
            rng = np.random.default_rng(seed)
            with torch.no_grad():
                for _, p in self.named_parameters():
                    bits = bf16(rng, tuple(p.shape)).astype(np.int16)
                    p.data = torch.from_numpy(bits).view(torch.bfloat16).clone()


if torch is not None:
    class FusedExperts(torch.nn.Module):
        """transformers v5's expert container: gate_up_proj [E, 2I, H] (gate rows first),
        down_proj [E, H, I], with the intermediate_dim and hidden_dim attributes it keeps."""
        def __init__(self):
            super().__init__()
            self.num_experts, self.hidden_dim, self.intermediate_dim = EXPERTS, HIDDEN, INTER
            self.gate_up_proj = torch.nn.Parameter(torch.empty(EXPERTS, 2 * INTER, HIDDEN))
            self.down_proj = torch.nn.Parameter(torch.empty(EXPERTS, HIDDEN, INTER))

    def fused_from_split(split: "HfMoe") -> "HfMoe":
        """The same weights as `split`, its experts held as transformers v5 fused parameters."""
        fused = HfMoe(seed=0)
        moe = fused.model.layers[0].mlp
        experts = moe.experts
        moe.experts = FusedExperts()
        with torch.no_grad():
            fused.load_state_dict({k: v for k, v in split.state_dict().items()
                                   if ".experts." not in k}, strict=False)
            src = split.model.layers[0].mlp.experts
            moe.experts.gate_up_proj.data = torch.stack(
                [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in src]).contiguous()
            moe.experts.down_proj.data = torch.stack([e.down_proj.weight for e in src]).contiguous()
        del experts
        return fused


@unittest.skipIf(torch is None, "torch is not installed for this Python (apt-get install "
                                "python3-torch)")
class TorchHelpersTest(DaemonTestCase):

    def expected_batches(self, batches):
        return [(m, [(n, _bits(t)) for n, t in ts]) for m, ts in batches]

    def test_hf_module_is_quantized(self):
        model = HfMoe(seed=60)
        batches = list(wt.conversion_batches(model))
        # gate and up of one expert share a batch; down_proj has its own.
        names = [[n for n, _ in ts] for _, ts in batches]
        e0 = "model.layers.0.mlp.experts.0."
        self.assertIn([e0 + "gate_proj.weight", e0 + "up_proj.weight"], names)
        self.assertIn([e0 + "down_proj.weight"], names)
        version = self.next_version()
        expected = reference(self.workdir, self.expected_batches(batches))
        report = wt.publish(self.pub, version, model, recipe="nvfp4")
        self.assertTrue(report.committed, report.summary())
        self.assertEqual(report.tensors_quantized, 3 * EXPERTS)
        self.assertReceivedEqual(expected, version)

    def test_transformers_v5_fused_experts_are_published_as_the_split_form(self):
        split = HfMoe(seed=63)
        fused = fused_from_split(split)
        flat = {n: _bits(t) for _, ts in wt.conversion_batches(split) for n, t in ts}
        batches = list(wt.conversion_batches(fused))
        got = {n: _bits(t) for _, ts in batches for n, t in ts}
        self.assertEqual(sorted(got), sorted(flat))
        for n in flat:
            self.assertTrue(np.array_equal(got[n], flat[n]), n)
        # Every expert's gate and up share a batch (one amax per pair), as in the split form.
        for _, ts in batches:
            names = [n for n, _ in ts]
            for n in names:
                if n.endswith("gate_proj.weight"):
                    self.assertIn(n.replace("gate_proj", "up_proj"), names)
        # Views of the fused parameters, not copies.
        gate0 = dict(next(ts for _, ts in batches if any("gate_proj" in n for n, _ in ts)))
        self.assertEqual(gate0["model.layers.0.mlp.experts.0.gate_proj.weight"].data_ptr(),
                         fused.model.layers[0].mlp.experts.gate_up_proj.data_ptr())
        # Through wpubd: the receiver holds exactly what the split-form model publishes.
        version = self.next_version()
        expected = reference(self.workdir, self.expected_batches(
            list(wt.conversion_batches(split))))
        report = wt.publish(self.pub, version, fused, recipe="nvfp4")
        self.assertTrue(report.committed, report.summary())
        self.assertEqual(report.tensors_quantized, 3 * EXPERTS)
        self.assertReceivedEqual(expected, version)
        # A state dict of it: names alone do not tell the layout -- refused naming the tensor,
        # published per expert through fused_experts_converter.
        state = fused.state_dict()
        with self.assertRaises(wpub.TensorError) as cm:
            list(wt.conversion_batches(state))
        self.assertIn("model.layers.0.mlp.experts.gate_up_proj", str(cm.exception))
        self.assertIn("fused_experts_converter", str(cm.exception))
        conv = wt.fused_experts_converter(HIDDEN, INTER)
        got = {n: _bits(t) for _, ts in wt.conversion_batches(state, conv) for n, t in ts}
        self.assertEqual(sorted(got), sorted(flat))
        for n in flat:
            self.assertTrue(np.array_equal(got[n], flat[n]), n)
        # Another layout under the same names (gpt-oss keeps gate_up as [E, H, 2I]): refused
        # (with hidden 48 and intermediate 32 the two layouts have different shapes; when
        # hidden == 2 x intermediate, as in this toy model, no shape can tell them apart).
        other = wt.fused_experts_converter(48, 32)
        with self.assertRaises(wpub.TensorError) as cm:
            other("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(EXPERTS, 48, 64))
        self.assertIn("not transformers v5's fused layout", str(cm.exception))

    def test_state_dict_with_converter_and_dtype(self):
        model = HfMoe(seed=61)
        # fp32 master weights cast to bf16; a converter that renames and drops the router.
        state = {f"module._orig_mod.{k}": v.float() for k, v in model.state_dict().items()}

        def convert(name, t):
            self.assertFalse(name.startswith("module."))  # wrapper segments cleaned
            return [] if name.endswith("mlp.gate.weight") else [(name, t)]

        batches = list(wt.conversion_batches(state, convert, dtype=torch.bfloat16))
        self.assertTrue(all(t.dtype == torch.bfloat16 for _, ts in batches for _, t in ts))
        self.assertNotIn("model.layers.0.mlp.gate.weight",
                         [n for _, ts in batches for n, _ in ts])
        version = self.next_version()
        expected = reference(self.workdir, self.expected_batches(batches))
        report = self.pub.publish(version, batches)
        self.assertTrue(report.committed, report.summary())
        self.assertReceivedEqual(expected, version)

    def test_async_module(self):
        model = HfMoe(seed=62)
        version = self.next_version()
        expected = reference(self.workdir,
                             self.expected_batches(list(wt.conversion_batches(model))))
        fut = wt.publish_async(self.pub, version, model)
        self.assertTrue(fut.result(timeout=60).committed)
        self.assertTrue(fut.released.is_set())
        self.assertReceivedEqual(expected, version)

    def test_megatron_per_expert_names(self):
        self.assertEqual(wt.megatron_expert_name(
            "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight", 8),
            "decoder.layers.3.mlp.experts.linear_fc1.weight13")
        self.assertEqual(wt.megatron_expert_name(
            "module.decoder.layers.3.mlp.experts.linear_fc2.weight2", 4),
            "module.decoder.layers.3.mlp.experts.linear_fc2.weight6")
        self.assertEqual(wt.megatron_expert_name("decoder.layers.3.mlp.router.weight", 4),
                         "decoder.layers.3.mlp.router.weight")
        # A SequentialMLP state dict of EP rank 1 (2 local experts) through a converter that
        # reads the global index the helper put into the name.
        rng = np.random.default_rng(63)
        state = {}
        for e in range(2):
            p = f"decoder.layers.0.mlp.experts.local_experts.{e}"
            state[f"{p}.linear_fc1.weight"] = torch.from_numpy(
                bf16(rng, (2 * INTER, HIDDEN)).astype(np.int16)).view(torch.bfloat16)
            state[f"{p}.linear_fc2.weight"] = torch.from_numpy(
                bf16(rng, (HIDDEN, INTER)).astype(np.int16)).view(torch.bfloat16)
        seen = []

        def to_hf(name, w):
            seen.append(name)
            e = name.rsplit("weight", 1)[1]
            h = f"model.layers.0.mlp.experts.{e}"
            if ".linear_fc1." in name:
                gate, up = w.chunk(2)
                return [(f"{h}.gate_proj.weight", gate), (f"{h}.up_proj.weight", up)]
            return [(f"{h}.down_proj.weight", w)]

        batches = list(wt.megatron_batches(state, to_hf, expert_offset=2))
        self.assertEqual(seen[0], "decoder.layers.0.mlp.experts.linear_fc1.weight2")
        self.assertEqual([m for m, _ in batches], seen)
        version = self.next_version()
        expected = reference(self.workdir, self.expected_batches(batches))
        report = self.pub.publish(version, batches)
        self.assertTrue(report.committed, report.summary())
        self.assertEqual(report.tensors_quantized, 6)
        self.assertReceivedEqual(expected, version)

    def test_batching_rules(self):
        t = torch.zeros(2, 16, dtype=torch.bfloat16)
        b = "model.layers.0.mlp.experts.0."
        state = {b + "gate_proj.weight": t, b + "down_proj.weight": t, b + "up_proj.weight": t,
                 "model.norm.weight": t, "lone.gate_proj.weight": t}
        batches = [(m, [n for n, _ in ts]) for m, ts in wt.conversion_batches(state)]
        self.assertEqual(batches, [
            (b + "gate_proj.weight", [b + "gate_proj.weight", b + "down_proj.weight",
                                      b + "up_proj.weight"]),
            ("model.norm.weight", ["model.norm.weight"]),
            ("lone.gate_proj.weight", ["lone.gate_proj.weight"])])  # the daemon names it
        with self.assertRaises(wpub.TensorError):
            list(wt.conversion_batches(state, lambda n, x: None))
        with self.assertRaises(wpub.TensorError):
            list(wt.conversion_batches(state, lambda n, x: [x]))
        self.assertEqual(wt.clean_name("module.model._fsdp_wrapped_module.layers.0._orig_mod."
                                       "_checkpoint_wrapped_module.mlp.weight"),
                         "model.layers.0.mlp.weight")


if __name__ == "__main__":
    unittest.main()

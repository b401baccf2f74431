"""Publishing through a real wpubd to a real wpub-recv: numpy inputs inline and through shared
memory, TP-shard concatenations, torch CPU inputs; the receiver's safetensors must equal the
NVFP4 CPU reference (quantized experts) and the inputs (passed-through tensors) byte for byte."""

import os
import unittest

import numpy as np

from harness import DaemonTestCase, as_wire, qwen3_batches, reference, wait_idle

import wpub

try:
    import torch
except ImportError:  # Debian 12 has no torch package
    torch = None


class PublishTest(DaemonTestCase):

    def publish_and_check(self, batches, wire_batches=None, **publish_kwargs):
        version = self.next_version()
        expected = reference(self.workdir, batches)
        report = self.pub.publish(version, wire_batches or as_wire(batches), model_id="qwen3-toy",
                                  **publish_kwargs)
        self.assertTrue(report.committed, report.summary())
        self.assertEqual(report.version, version)
        self.assertReceivedEqual(expected, version)
        return report

    def test_numpy_inline(self):
        pub = wpub.Publisher(self.daemon.target, shm_threshold_bytes=None, chunk_bytes=1000)
        batches = qwen3_batches(seed=1)
        version = self.next_version()
        expected = reference(self.workdir, batches)
        report = pub.publish(version, as_wire(batches))
        pub.close()
        self.assertTrue(report.committed)
        self.assertReceivedEqual(expected, version)
        total = sum(a.nbytes for _, ts in batches for _, a in ts)
        self.assertEqual(report.client.inline_bytes, total)
        self.assertEqual(report.client.shm_bytes, 0)
        self.assertEqual(report.bytes_in, total)
        # 1000-byte chunks: one header, one message per batch, the chunks, one commit.
        chunks = sum(-(-a.nbytes // 1000) for _, ts in batches for _, a in ts)
        self.assertEqual(report.client.messages, 2 + len(batches) + chunks)
        self.assertEqual(report.tensors_quantized, 4 * 3)
        self.assertGreater(report.tensors_passthrough, 0)
        self.assertEqual(len(report.receivers), 1)
        self.assertTrue(report.receivers[0].committed)

    def own_segments(self):
        return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"wpub-{os.getpid()}-"))

    def test_numpy_shm(self):
        pub = wpub.Publisher(self.daemon.target, shm_threshold_bytes=0, reuse_shm=False)
        batches = qwen3_batches(seed=2)
        version = self.next_version()
        expected = reference(self.workdir, batches)
        report = pub.publish(version, as_wire(batches))
        self.assertTrue(report.committed)
        self.assertReceivedEqual(expected, version)
        self.assertEqual(report.client.inline_bytes, 0)
        self.assertEqual(report.client.shm_bytes, report.bytes_in)
        self.assertEqual(report.client.messages, 2 + len(batches))
        # reuse_shm=False: every segment is unlinked once the report arrived.
        self.assertEqual(self.own_segments(), [])
        pub.close()

    def test_numpy_shm_segments_reused(self):
        pub = wpub.Publisher(self.daemon.target, shm_threshold_bytes=0)
        first = qwen3_batches(seed=15)
        second = qwen3_batches(seed=16)  # same shapes, new values: the same segments refilled
        v1 = self.next_version()
        self.assertTrue(pub.publish(v1, as_wire(first)).committed)
        self.assertReceivedEqual(reference(self.workdir, first), v1)
        kept = self.own_segments()
        self.assertEqual(len(kept), len(first))
        v2 = self.next_version()
        self.assertTrue(pub.publish(v2, as_wire(second)).committed)
        self.assertReceivedEqual(reference(self.workdir, second), v2)
        self.assertEqual(self.own_segments(), kept)
        pub.close()
        self.assertEqual(self.own_segments(), [])

    def test_shm_empty_zero_copy(self):
        # Arrays allocated by Publisher.shm_empty travel as references to their segments: no
        # copy, and refilling them in place publishes the new values.
        pub = wpub.Publisher(self.daemon.target, shm_threshold_bytes=None)  # else: inline
        source = qwen3_batches(seed=17)
        bufs = [(m, [(n, pub.shm_empty(a.shape, np.uint16)) for n, a in ts]) for m, ts in source]
        wire = [(m, [(n, wpub.Tensor(b, "bfloat16")) for n, b in ts]) for m, ts in bufs]
        for step, seed in enumerate((17, 18)):
            values = qwen3_batches(seed=seed)
            for (_, ts), (_, vs) in zip(bufs, values):
                for (_, b), (_, v) in zip(ts, vs):
                    b[...] = v
            version = self.next_version()
            report = pub.publish(version, wire)
            self.assertTrue(report.committed)
            self.assertEqual(report.client.shm_zero_copy_bytes, report.bytes_in)
            self.assertEqual(report.client.inline_bytes + report.client.shm_bytes, 0)
            self.assertReceivedEqual(reference(self.workdir, values), version)
        pub.close()
        self.assertEqual(self.own_segments(), [])

    def test_mixed_routes_and_generator(self):
        # 4 KiB threshold: the [32, 64] bf16 experts (4 KiB) go through shm, norms inline; the
        # batches come from a generator, converted one by one as the stream advances.
        pub = wpub.Publisher(self.daemon.target, shm_threshold_bytes=4096)
        batches = qwen3_batches(seed=3, layers=(0, 1))
        version = self.next_version()
        expected = reference(self.workdir, batches)
        produced = []

        def convert():
            for m, ts in batches:
                produced.append(m)
                yield m, [(n, wpub.Tensor(a, dtype="bfloat16")) for n, a in ts]

        report = pub.publish(version, convert(), recipe="nvfp4")
        pub.close()
        self.assertEqual(len(produced), len(batches))
        self.assertTrue(report.committed)
        self.assertGreater(report.client.inline_bytes, 0)
        self.assertGreater(report.client.shm_bytes, 0)
        self.assertReceivedEqual(expected, version)

    def test_tp_shards_concat(self):
        # Two "TP shards" per expert weight: gate/up split along dim 0 (column parallel), down
        # along dim 1 (row parallel), each shard its own array (own allocation); passthrough
        # tensors split too. The receiver sees the assembled tensors.
        batches = qwen3_batches(seed=4)
        wire = []
        for m, ts in batches:
            out = []
            for n, a in ts:
                dim = 1 if n.endswith("down_proj.weight") or n.endswith("o_proj.weight") else 0
                if a.ndim < 2:
                    out.append((n, wpub.Tensor(a, dtype="bfloat16")))
                    continue
                halves = [np.array(h) for h in np.split(a, 2, axis=dim)]
                out.append((n, wpub.concat([wpub.Tensor(h, dtype="bfloat16") for h in halves], dim)))
            wire.append((m, out))
        self.publish_and_check(batches, wire)

    def test_float32_and_dtype_forms(self):
        rng = np.random.default_rng(5)
        gate = rng.standard_normal((32, 64), dtype=np.float32)
        up = rng.standard_normal((32, 64), dtype=np.float32)
        bias = rng.standard_normal((64,), dtype=np.float32)
        version = self.next_version()
        report = self.pub.publish(version, [
            ("decoder.layers.0.mlp.experts.linear_fc1.weight0",
             [("model.layers.0.mlp.experts.0.gate_proj.weight", gate),
              ("model.layers.0.mlp.experts.0.up_proj.weight", up)]),
            ("decoder.layers.0.self_attention.linear_qkv.bias",
             [("model.layers.0.self_attn.q_proj.bias", bias)])], recipe="bf16")
        self.assertTrue(report.committed)
        got, _ = self.received(0, version)
        # recipe bf16: everything passes through in its source precision.
        self.assertEqual(got["model.layers.0.mlp.experts.0.gate_proj.weight"],
                         ("float32", (32, 64), gate.tobytes()))
        self.assertEqual(got["model.layers.0.self_attn.q_proj.bias"],
                         ("float32", (64,), bias.tobytes()))

    @unittest.skipIf(torch is None, "torch is not installed for this Python (Debian ships none)")
    def test_torch_cpu(self):
        batches = qwen3_batches(seed=6)
        wire = [(m, [(n, torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16)) for n, a in ts])
                for m, ts in batches]
        self.publish_and_check(batches, wire)

    def test_status_and_reports(self):
        version = self.next_version()
        report = self.pub.publish(version, as_wire(qwen3_batches(seed=7)))
        status = wait_idle(self.pub)
        self.assertEqual(status.committed_version, version)
        self.assertTrue(status.serving)
        self.assertEqual(status.backend, "cpu")
        self.assertEqual([r.name for r in status.receivers], ["recv-0"])
        self.assertEqual(status.recent_reports[0].version, version)
        reports = self.pub.list_reports(limit=2)
        self.assertEqual(reports[0].version, version)
        self.assertEqual(reports[0].bytes_out, report.bytes_out)
        p = report.phases
        self.assertGreater(report.wall_seconds, 0)
        self.assertGreaterEqual(p.quantize + p.pack + p.transfer + p.commit, 0)
        self.assertGreater(report.client.total_seconds, 0)
        self.assertGreaterEqual(report.client.total_seconds, report.client.send_seconds)
        self.assertGreater(report.client.cpu_seconds, 0)
        self.assertIn(f"v{version} COMMITTED", report.summary())


if __name__ == "__main__":
    unittest.main()

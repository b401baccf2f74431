#!/usr/bin/env python3
"""Client-side overhead of publish() for torch CUDA tensors (CUDA IPC references, no copy) of
the Qwen3-30B-A3B shape, on a GPU host.

wpubd's GPU ingestion is another issue, so the stream goes to an in-process sink that accepts
the Publisher API and drops the messages (request bytes are not even parsed): the figures are
the client's own cost: describing every tensor (driver-API IPC export per tensor, one stream
synchronize per batch), building and sending the messages.

    bench_cuda_ipc.py [--layers 48] [--repeats 3]
"""

import argparse
import os
import sys
import time
from concurrent import futures

import grpc
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
import wpub  # noqa: E402
from wpub._proto import pb  # noqa: E402

HIDDEN, EXPERTS, MOE_INTER, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 128, 768, 32, 4, 128, 151936


def sink_server():
    """A Publisher endpoint that counts the stream's messages and answers COMMITTED."""
    def publish(requests, context):
        n = sum(1 for _ in requests)
        return pb.PublicationReport(status=1, version=n)

    def get_status(request, context):
        return pb.GetStatusResponse(serving=True)

    handler = grpc.method_handlers_generic_handler("wpub.v1.Publisher", {
        "Publish": grpc.stream_unary_rpc_method_handler(
            publish, request_deserializer=None,
            response_serializer=pb.PublicationReport.SerializeToString),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            get_status, request_deserializer=pb.GetStatusRequest.FromString,
            response_serializer=pb.GetStatusResponse.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(2),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def model(layers):
    """The converted HF tensors, bf16 on the GPU, one allocation each (as a converter makes)."""
    def t(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    out = [("embedding.word_embeddings.weight", [("model.embed_tokens.weight", t(VOCAB, HIDDEN))])]
    for L in range(layers):
        m, h = f"decoder.layers.{L}", f"model.layers.{L}"
        out.append((f"{m}.self_attention.linear_qkv.weight", [
            (f"{h}.self_attn.q_proj.weight", t(Q_HEADS * HEAD_DIM, HIDDEN)),
            (f"{h}.self_attn.k_proj.weight", t(KV_HEADS * HEAD_DIM, HIDDEN)),
            (f"{h}.self_attn.v_proj.weight", t(KV_HEADS * HEAD_DIM, HIDDEN))]))
        out.append((f"{m}.self_attention.linear_proj.weight",
                    [(f"{h}.self_attn.o_proj.weight", t(HIDDEN, Q_HEADS * HEAD_DIM))]))
        for name, hf, shape in (("q_layernorm", "self_attn.q_norm", (HEAD_DIM,)),
                                ("k_layernorm", "self_attn.k_norm", (HEAD_DIM,)),
                                ("input_layernorm", "input_layernorm", (HIDDEN,)),
                                ("pre_mlp_layernorm", "post_attention_layernorm", (HIDDEN,)),
                                ("mlp.router", "mlp.gate", (EXPERTS, HIDDEN))):
            out.append((f"{m}.{name}.weight", [(f"{h}.{hf}.weight", t(*shape))]))
        for e in range(EXPERTS):
            out.append((f"{m}.mlp.experts.linear_fc1.weight{e}", [
                (f"{h}.mlp.experts.{e}.gate_proj.weight", t(MOE_INTER, HIDDEN)),
                (f"{h}.mlp.experts.{e}.up_proj.weight", t(MOE_INTER, HIDDEN))]))
            out.append((f"{m}.mlp.experts.linear_fc2.weight{e}",
                        [(f"{h}.mlp.experts.{e}.down_proj.weight", t(HIDDEN, MOE_INTER))]))
    out.append(("decoder.final_layernorm.weight", [("model.norm.weight", t(HIDDEN))]))
    out.append(("output_layer.weight", [("lm_head.weight", t(VOCAB, HIDDEN))]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    server, target = sink_server()
    batches = model(args.layers)
    nbytes = sum(x.numel() * 2 for _, ts in batches for _, x in ts)
    ntensors = sum(len(ts) for _, ts in batches)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: {args.layers} layers, {len(batches)} batches, "
          f"{ntensors} tensors, {nbytes / 1e9:.1f} GB on the GPU", flush=True)
    pub = wpub.Publisher(target)
    for r in range(args.repeats):
        report = pub.publish(r + 1, batches)
        c = report.client
        print(f"run {r}: send {c.send_seconds:.3f}s, total {c.total_seconds:.3f}s, process CPU "
              f"{c.cpu_seconds:.3f}s (sink server included), caller CPU "
              f"{c.caller_cpu_seconds:.3f}s, {c.messages} messages, "
              f"{c.cuda_ipc_bytes / 1e9:.1f} GB by IPC, "
              f"{c.caller_cpu_seconds / ntensors * 1e6:.1f} us caller CPU per tensor", flush=True)
    pub.close()
    server.stop(0)


if __name__ == "__main__":
    main()

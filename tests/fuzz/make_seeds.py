#!/usr/bin/python3
"""Writes the seed corpus of every fuzz target (tests/fuzz/corpus/<target>/seed-*).

Run with Debian's python3 (it has protobuf): /usr/bin/python3 tests/fuzz/make_seeds.py
Seeds are valid inputs (plus a few near misses) so that mutations start from messages the
code accepts. Files named other than seed-* (reproducers of fixed crashes, `crash-*`) are left
alone. The Publish messages come from the wire API's descriptor set shipped with the Python
client, so they are the real wpub.v1 encoding.
"""

import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "clients", "python"))
from wpub._proto import pb  # noqa: E402


def write(target, seeds):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        if f.startswith("seed-"):
            os.remove(os.path.join(d, f))
    for i, s in enumerate(seeds):
        with open(os.path.join(d, "seed-%02d" % i), "wb") as f:
            f.write(s)


# ---- publish: length-delimited PublishRequest messages -------------------------------------

def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def stream(messages):
    out = bytearray()
    for m in messages:
        data = m.SerializeToString()
        out += varint(len(data)) + data
    return bytes(out)


def header(version=1, recipe="bf16", **kw):
    m = pb.PublishRequest()
    m.header.version = version
    m.header.model_id = "fuzz"
    m.header.recipe = recipe
    for k, v in kw.items():
        if k == "exceptions":
            for ek, ev in v.items():
                f = getattr(m.header.precision_exceptions, ek)
                if isinstance(ev, list):
                    f.extend(ev)
                else:
                    setattr(m.header.precision_exceptions, ek, ev)
            continue
        setattr(m.header, k, v)
    return m


def batch(megatron, tensors):
    """tensors: (name, dtype, shape, parts, concat_dim); parts: [(shape, source)] with source
    "inline" or ("shm", name, offset, length)."""
    m = pb.PublishRequest()
    m.batch.megatron_name = megatron
    for name, dtype, shape, parts, concat_dim in tensors:
        t = m.batch.tensors.add()
        t.name, t.dtype, t.concat_dim = name, dtype, concat_dim
        t.shape.extend(shape)
        for pshape, src in parts:
            p = t.parts.add()
            p.shape.extend(pshape)
            if src == "inline":
                p.inline.SetInParent()
            else:
                _, seg, off, length = src
                p.shm.name, p.shm.offset, p.shm.length = seg, off, length
    return m


def chunk(b, t, p, offset, data):
    m = pb.PublishRequest()
    m.chunk.batch_index, m.chunk.tensor_index, m.chunk.part_index = b, t, p
    m.chunk.offset, m.chunk.data = offset, data
    return m


def commit():
    m = pb.PublishRequest()
    m.commit.SetInParent()
    return m


def bf16(n, v=0x3F80):
    return struct.pack("<%dH" % n, *[(v + i) & 0x7F7F for i in range(n)])


def one(name, dtype, shape):
    return (name, dtype, shape, [(shape, "inline")], 0)


def publish_seeds():
    E = "decoder.layers.1.mlp.experts."
    H = "model.layers.1.mlp.experts.0."
    norm = batch("decoder.final_layernorm.weight", [one("model.norm.weight", "bfloat16", [8])])
    pair = batch(E + "linear_fc1.weight0", [one(H + "gate_proj.weight", "bfloat16", [4, 32]),
                                          one(H + "up_proj.weight", "bfloat16", [4, 32])])
    down = batch(E + "linear_fc2.weight0", [one(H + "down_proj.weight", "bfloat16", [32, 16])])
    seeds = [
        stream([header(), norm, chunk(0, 0, 0, 0, bf16(8)), commit()]),
        stream([header(recipe="nvfp4"), pair, down, chunk(0, 0, 0, 0, bf16(128)),
                chunk(0, 1, 0, 0, bf16(64)), chunk(0, 1, 0, 128, bf16(64, 0x3E00)),
                chunk(1, 0, 0, 0, bf16(512)), commit()]),
        stream([header(version=7, recipe="nvfp4_4over6:mse-e448-fp16", bucket_bytes=1024),
                pair, chunk(0, 0, 0, 0, bf16(128)), chunk(0, 1, 0, 0, bf16(128)), commit()]),
        # Two parts along dim 1 and along dim 0.
        stream([header(), batch("decoder.layers.0.self_attention.linear_qkv.weight", [
            ("model.layers.0.self_attn.q_proj.weight", "float32", [4, 8],
             [([4, 4], "inline"), ([4, 4], "inline")], 1),
            ("model.layers.0.self_attn.k_proj.weight", "float16", [4, 8],
             [([2, 8], "inline"), ([2, 8], "inline")], 0)]),
            chunk(0, 0, 0, 0, b"\x00\x00\x80\x3f" * 16), chunk(0, 0, 1, 0, b"\x00\x00\x80\x3f" * 16),
            chunk(0, 1, 0, 0, b"\x00\x3c" * 16), chunk(0, 1, 1, 0, b"\x00\x3c" * 16), commit()]),
        # Shared memory (the target points valid names at its own segment).
        stream([header(recipe="nvfp4"), batch(E + "linear_fc2.weight0", [
            (H + "down_proj.weight", "bfloat16", [32, 16], [([32, 16], ("shm", "/wpub-seg", 0, 1024))],
             0)]), commit()]),
        # Ignore rules and precision exceptions.
        stream([header(recipe="nvfp4", quantization_config_json=json.dumps(
            {"quant_algo": "NVFP4", "ignore": ["lm_head", "re:model\\.layers\\.2\\..*"],
             "exclude_modules": ["model.layers.0"]}),
            exceptions={"first_last_layers_bf16": True, "num_layers": 3,
                        "num_layers_at_start_in_bf16": 1,
                        "extra_high_precision_layers_megatron": ["linear_q_up_proj"]}),
            pair, chunk(0, 0, 0, 0, bf16(128)), chunk(0, 1, 0, 0, bf16(128)), commit()]),
        # Stacked experts [E, M, K].
        stream([header(recipe="nvfp4"), batch(E + "linear_fc1.weight", [
            one("model.layers.1.mlp.experts.gate_up_proj", "bfloat16", [2, 4, 32])]),
            chunk(0, 0, 0, 0, bf16(256)), commit()]),
        # Near misses: a chunk before any batch, a second header, no commit, allow_non_finite.
        stream([header(), chunk(0, 0, 0, 0, b"x"), commit()]),
        stream([header(), norm, header(version=2), commit()]),
        stream([header(allow_non_finite=True), norm, chunk(0, 0, 0, 0, b"\xff\x7f" * 8)]),
        stream([header(allow_non_finite=True, queue=True), norm,
                chunk(0, 0, 0, 0, b"\xff\x7f" * 8), commit()]),
    ]
    return seeds


# ---- safetensors --------------------------------------------------------------------------

def safetensors_file(tensors, metadata=None):
    hdr, data, off = {}, b"", 0
    if metadata is not None:
        hdr["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(payload)]}
        data += payload
        off += len(payload)
    text = json.dumps(hdr).encode()
    return struct.pack("<Q", len(text)) + text + data


def safetensors_seeds():
    return [
        safetensors_file([("w", "BF16", [2, 3], bf16(6))]),
        safetensors_file([("a", "F32", [2], b"\x00" * 8), ("b", "U8", [], b"\x07"),
                          ("c", "I64", [0, 4], b"")], {"format": "pt"}),
        safetensors_file([("x.weight", "F8_E4M3", [4, 4], bytes(range(16))),
                          ("x.weight_scale", "F8_E4M3", [4, 1], b"\x38" * 4),
                          ("x.weight_scale_2", "F32", [], b"\x00\x00\x80\x3f")]),
        safetensors_file([]),
        safetensors_file([("t", "I16", [3], b"\x01\x00" * 3), ("u", "BOOL", [1], b"\x01")],
                         {"total": "1"}),
        b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
        # NVFP4 modules as `wpubctl inspect` groups them: rank 2 with input_scale, a stack of two
        # slices, an empty stack, and a block scale of the wrong shape.
        safetensors_file([("m.experts.0.w.weight", "U8", [2, 8], bytes(range(16))),
                          ("m.experts.0.w.weight_scale", "F8_E4M3", [2, 1], b"\x40\x38"),
                          ("m.experts.0.w.weight_scale_2", "F32", [], b"\x00\x00\x80\x3e"),
                          ("m.experts.0.w.input_scale", "F32", [], b"\x00\x00\x80\x3f")]),
        safetensors_file([("s.weight", "U8", [2, 1, 8], bytes(range(16))),
                          ("s.weight_scale", "F8_E4M3", [2, 1, 1], b"\x40\x38"),
                          ("s.weight_scale_2", "F32", [2], b"\x00\x00\x80\x3e" * 2)]),
        safetensors_file([("e.weight", "U8", [0, 2, 8], b""),
                          ("e.weight_scale", "F8_E4M3", [0, 2, 1], b""),
                          ("e.weight_scale_2", "F32", [0], b"")]),
        safetensors_file([("b.weight", "U8", [2, 8], bytes(16)),
                          ("b.weight_scale", "F8_E4M3", [1, 2], b"\x40\x40"),
                          ("b.weight_scale_2", "F32", [1], b"\x00\x00\xc0\x7f")]),
        # A packed K beyond int64 / 2 behind a zero dim (the header is valid).
        safetensors_file([("g.weight", "U8", [0, 4611686018427387904], b""),
                          ("g.weight_scale", "F8_E4M3", [0, 1], b"")]),
    ]


# ---- tcp_store: [connection][length][bytes] segments of TCPStore requests ------------------

MAGIC = 0x3C85F7CE


def s(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def q(kind, *parts):
    return bytes([kind]) + b"".join(parts)


VALIDATE = q(0, struct.pack("<I", MAGIC))


def segments(*conn_bytes):
    out = bytearray()
    for conn, data in conn_bytes:
        for i in range(0, len(data), 200):
            piece = data[i:i + 200]
            out += bytes([conn, len(piece)]) + piece
    return bytes(out)


def tcp_store_seeds():
    return [
        segments((0, VALIDATE + q(13, struct.pack("<I", 7)) + q(1, s("k"), s("v")) + q(3, s("k")))),
        segments((0, VALIDATE + q(4, s("init/"), struct.pack("<q", 1)) +
                  q(4, s("init/"), struct.pack("<q", 2)) + q(7) + q(8, s("init/")))),
        segments((1, VALIDATE + q(6, struct.pack("<Q", 1), s("/g/g//cuda//0"))),
                 (0, VALIDATE + q(1, s("/g/g//cuda//0"), s(b"\x01" * 128)))),
        segments((0, VALIDATE + q(11, struct.pack("<Q", 2), s("a"), s("1"), s("b"), s("2")) +
                  q(10, struct.pack("<Q", 2), s("a"), s("b")) +
                  q(5, struct.pack("<Q", 2), s("a"), s("c")))),
        segments((0, VALIDATE + q(2, s("x"), s(""), s("new")) + q(2, s("x"), s("new"), s("newer")) +
                  q(9, s("x"), s("+tail")) + q(3, s("x")))),
        segments((2, VALIDATE + q(6, struct.pack("<Q", 2), s("p"), s("q")) + q(12)),
                 (0, VALIDATE + q(1, s("p"), s("1")))),
        segments((0, q(0, struct.pack("<I", 0)))),
        segments((0, VALIDATE + q(3, s("missing")))),
    ]


# ---- update_request: /update_weights_from_distributed bodies -----------------------------

def update_request_seeds():
    base = {"names": ["model.layers.0.mlp.experts.0.down_proj.weight", "model.norm.weight"],
            "dtypes": ["uint8", "bfloat16"], "shapes": [[64, 16], [64]],
            "group_name": "wpub_weights_1", "flush_cache": False, "weight_version": "3",
            "load_format": "flattened_bucket"}
    seq = dict(base, wpub_sequence=5)
    odd = {"names": ["a\"b\\c\u00e9", "s"], "dtypes": ["float8_e4m3fn", "torch.float32"],
           "shapes": [[2, 0, 3], []], "flush_cache": True, "extra": {"nested": [1, 2, {"x": None}]}}
    return [json.dumps(base).encode(), json.dumps(seq).encode(), json.dumps(odd).encode(),
            b'{"names":[],"dtypes":[],"shapes":[]}',
            b'{"names":["x"],"dtypes":["bf16"],"shapes":[[-1]]}',
            b'{"names":["x"],"dtypes":["bfloat16"],"shapes":[[4611686018427387904,4]]}']


# ---- sglang_answers: byte 0 even = JSON body of a 200, odd = a raw HTTP answer ------------

def sglang_answers_seeds():
    return [
        b"\x00" + b'{"success": true, "message": "Succeeded to update parameter online."}',
        b"\x00" + b'{"success": false, "message": "Failed to update weights: shape mismatch"}',
        b"\x00" + b'{}',
        b"\x00" + b'[1, 2, 3]',
        b"\x01HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        b"\x01HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\nerror",
        b"\x01HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"10\r\n{\"success\":false\r\n2\r\n}\n\r\n0\r\n\r\n",
        b"\x01HTTP/1.0 200 OK\r\n\r\n{\"success\": true}",
    ]


# ---- policy: byte 0 = 0 settings, 1 quantization config, 2 rules \0 names ----------------

def policy_seeds():
    settings = {"recipe": "nvfp4",
                "quantization_config": {"quant_algo": "NVFP4", "quant_method": "modelopt",
                                        "ignore": ["lm_head"], "exclude_modules": []},
                "extra_high_precision_layers_megatron": ["self_attention.linear_q_up_proj"],
                "extra_high_precision_layers_hf": ["self_attn.q_b_proj"],
                "first_last_layers_bf16": True, "num_layers": 3,
                "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}
    return [
        b"\x00" + json.dumps(settings).encode(),
        b"\x00" + json.dumps({"recipe": "bf16"}).encode(),
        b"\x00" + json.dumps({"recipe": "nvfp4_4over6", "quantization_config": {
            "quantization_config": {"quant_method": "modelopt_fp4", "group_size": 16,
                                    "ignore": "re:.*shared_experts.*"}}}).encode(),
        b"\x01" + json.dumps({"quantization": {"quant_algo": "NVFP4", "exclude_modules": [
            "lm_head", "model.layers.1.mlp.experts.0", "re:model\\.layers\\.[0-9]+\\.self_attn.*"]},
            "producer": {"name": "modelopt"}}).encode(),
        b"\x01" + json.dumps({"quant_algo": "FP8", "ignore": None}).encode(),
        b"\x02lm_head\nmodel.layers.1\nre:.*\\.gate_proj\\..*\x00lm_head.weight\n"
        b"model.layers.1.mlp.experts.0.gate_proj.weight\nmodel.layers.10.x",
        b"\x02a\na.b\n..\n\x00a.b.c\na..b\n.a",
    ]


def main():
    write("publish", publish_seeds())
    write("safetensors", safetensors_seeds())
    write("tcp_store", tcp_store_seeds())
    write("update_request", update_request_seeds())
    write("sglang_answers", sglang_answers_seeds())
    write("policy", policy_seeds())


if __name__ == "__main__":
    main()

"""Model shapes -> the units wpub publishes, and the bucket plan of a list of units.

A unit is what the planner never splits across buckets (core/engine/README.md, "Bucket
layout"): one passed-through tensor, or one quantized input with its three outputs
(`X.weight` packed E2M1 codes, `X.weight_scale` E4M3 per 16 elements, `X.weight_scale_2` fp32).
Routed-expert weights are NVFP4, everything else keeps its source dtype (docs/specs/policy.md).
"""

from dataclasses import dataclass

BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class Unit:
    in_bytes: int     # bytes the publisher reads (source precision)
    out_bytes: int    # bytes on the wire
    entries: int      # names in the bucket's update request (3 for a quantized input)
    quantized: bool
    expert: bool      # a routed-expert weight (sharded by EP on the engine)


def nvfp4_out_bytes(m, k):
    """Packed codes (k/2 per row), E4M3 scales (k/16 per row), one fp32 global scale."""
    return m * k // 2 + m * k // 16 + FP32


def _pass(shape, elem=BF16):
    n = 1
    for d in shape:
        n *= d
    return Unit(n * elem, n * elem, 1, False, False)


def _expert(m, k, elem=BF16):
    return Unit(m * k * elem, nvfp4_out_bytes(m, k), 3, True, True)


def _attention(cfg, h):
    a = cfg["attention"]
    heads = a["heads"]
    out = [_pass([h]), _pass([h])]  # input_layernorm, post_attention_layernorm
    if a["kind"] == "gqa":
        d, kv = a["head_dim"], a["kv_heads"]
        out += [_pass([heads * d, h]), _pass([kv * d, h]), _pass([kv * d, h]),
                _pass([h, heads * d])]
        if a.get("qk_norm"):
            out += [_pass([d]), _pass([d])]
        return out
    # MLA (DeepSeek-V3 family): q_a/q_b with a LoRA rank, joint kv_a with the rope key, kv_b.
    nope, rope, v = a["qk_nope_head_dim"], a["qk_rope_head_dim"], a["v_head_dim"]
    ql, kvl = a["q_lora_rank"], a["kv_lora_rank"]
    out += [_pass([ql, h]), _pass([ql]), _pass([heads * (nope + rope), ql]),
            _pass([kvl + rope, h]), _pass([kvl]), _pass([heads * (nope + v), kvl]),
            _pass([h, heads * v])]
    idx = a.get("indexer")  # DeepSeek sparse attention's lightning indexer
    if idx:
        ih, idim = idx["heads"], idx["head_dim"]
        out += [_pass([ih * idim, ql]), _pass([idim, h]), _pass([idim]), _pass([idim]),
                _pass([ih, h])]
    return out


def _mlp(h, inter):
    return [_pass([inter, h]), _pass([inter, h]), _pass([h, inter])]


def _moe(cfg, h):
    e, mi = cfg["experts"], cfg["moe_inter"]
    out = [_pass([e, h])]  # router
    if cfg.get("router_bias"):
        out.append(_pass([e], FP32))
    if cfg.get("shared_experts", 0):
        out += _mlp(h, cfg["shared_experts"] * mi)
    for _ in range(e):
        out += [_expert(mi, h), _expert(mi, h), _expert(h, mi)]  # gate, up, down
    return out


def model_units(cfg):
    """Every unit of one publication of the whole model, in publication order."""
    h, layers = cfg["hidden"], cfg["layers"]
    dense = cfg.get("dense_layers", 0)
    units = []
    if cfg.get("embeddings", True):
        units.append(_pass([cfg["vocab"], h]))
    for i in range(layers + cfg.get("mtp_layers", 0)):
        if i >= layers:  # MTP: enorm, hnorm, eh_proj, shared_head.norm, then a MoE layer
            units += [_pass([h]), _pass([h]), _pass([h, 2 * h]), _pass([h])]
        units += _attention(cfg, h)
        units += _mlp(h, cfg["dense_inter"]) if i < dense else _moe(cfg, h)
    if cfg.get("embeddings", True):
        units.append(_pass([h]))  # final norm
        if not cfg.get("tie_embeddings", False):
            units.append(_pass([cfg["vocab"], h]))
    return units


@dataclass
class Totals:
    units: int = 0
    tensors_quantized: int = 0
    tensors_passed: int = 0
    in_bytes: int = 0
    in_bytes_quantized: int = 0
    out_bytes: int = 0
    out_bytes_expert: int = 0
    entries: int = 0
    params: int = 0


def totals(units):
    t = Totals()
    for u in units:
        t.units += 1
        t.in_bytes += u.in_bytes
        t.out_bytes += u.out_bytes
        t.entries += u.entries
        if u.quantized:
            t.tensors_quantized += 1
            t.in_bytes_quantized += u.in_bytes
            t.params += u.in_bytes // BF16
        else:
            t.tensors_passed += 1
            t.params += u.in_bytes // BF16  # fp32 biases count double: negligible
        if u.expert:
            t.out_bytes_expert += u.out_bytes
    return t


@dataclass
class Bucket:
    out_bytes: int = 0
    in_bytes_quantized: int = 0
    in_bytes_passed: int = 0
    entries: int = 0


def plan_buckets(units, bucket_bytes):
    """Greedy in publication order, as the planner: a unit that does not fit starts a bucket;
    a unit larger than a bucket gets its own."""
    buckets = []
    cur = Bucket()
    for u in units:
        if cur.out_bytes and cur.out_bytes + u.out_bytes > bucket_bytes:
            buckets.append(cur)
            cur = Bucket()
        cur.out_bytes += u.out_bytes
        cur.entries += u.entries
        if u.quantized:
            cur.in_bytes_quantized += u.in_bytes
        else:
            cur.in_bytes_passed += u.in_bytes
    if cur.out_bytes:
        buckets.append(cur)
    return buckets


def bf16_all(units):
    """The same units published with recipe bf16 (nothing quantized)."""
    return [Unit(u.in_bytes, u.in_bytes, 1, False, u.expert) for u in units]

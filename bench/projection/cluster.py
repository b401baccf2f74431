"""A publication at scale: several publishers on the trainer nodes, engines on other nodes.

Two designs, both driving the same per-publisher pipeline (pipeline.publish):
  broadcast    wpub's design: each publisher broadcasts its share of the buckets on its own
               group of every engine GPU, so every engine GPU receives every byte.
  many2many    the sharded transfer: every engine GPU receives only the shard its EP/TP rank
               loads, point to point from the publishers that hold it.
What bounds the transfer, per design (rates from inputs.yaml `links`):
  broadcast    max(share / publisher NIC, model / engine node's NICs, model / NVLink receive)
  many2many    max(sent per publisher / its NICs, shard per engine GPU / that GPU's NIC)
"""

from dataclasses import dataclass

import shapes
from pipeline import Link, publish
from validate import number, values

WIRE_FP8 = "fp8"  # the anchors' engines load FP8: one byte per expert element plus scales


@dataclass
class Result:
    design: str
    publishers: int
    wire_bytes_model: float   # one copy of the model on the wire
    per_engine_gpu_bytes: float
    per_publisher_sent: float
    bound_s: float            # the link bound of the transfer alone
    bound_what: str
    stages: object            # pipeline.Stages of one publisher
    coordination_s: float
    ingest_s: float           # the trainer describing its tensors (before Commit)
    wall_s: float             # publication: Commit to the version applied everywhere


def fp8_units(units):
    """The same model with FP8 experts (1 B per element + fp32 block scales 128x128)."""
    out = []
    for u in units:
        if u.expert:
            n = u.in_bytes // shapes.BF16
            out.append(shapes.Unit(u.in_bytes, n + n // (128 * 128) * 4, 2, True, True))
        else:
            out.append(u)
    return out


def _links(data):
    lk = {k: number(v["value"]) for k, v in data["links"].items() if k != "hbm_scale"}
    lk["hbm"] = {g: number(v["value"]) for g, v in data["links"]["hbm_scale"].items()}
    return lk


def project(data, model, layout, design, *, publishers_per_node=1, wire="nvfp4",
            check_first=True, lanes=3, bucket_bytes=1 << 30, profile="current"):
    p = values(data["profiles"][profile])
    lk = _links(data)
    coord = data["coordination"]
    tr, en = layout["trainer"], layout["engine"]
    units = shapes.model_units(data["models"][model])
    if wire == WIRE_FP8:
        units = fp8_units(units)
    elif wire == "bf16":
        units = shapes.bf16_all(units)
    tot = shapes.totals(units)
    P = tr["nodes"] * publishers_per_node
    mine = units[0::P] if P > 1 else units  # round robin: every publisher holds 1/P of each kind
    S = float(tot.out_bytes)
    E = float(tot.out_bytes_expert)
    D = S - E
    n_gpu = en["nodes"] * en["gpus_per_node"]
    G = en["gpus_per_engine"]
    n_eng = n_gpu // G
    nic = lk["nic_Bps"] * lk["nic_efficiency"]
    share = sum(u.out_bytes for u in mine)
    if design == "broadcast":
        per_gpu = S
        sent = share                       # a ring: the publisher sends its share once
        egress = nic                       # one GPU's ring leaves through its own NIC
        ingress_node = en["gpus_per_node"] * nic
        cands = [(share / egress, "publisher NIC"),
                 (S / ingress_node, "engine node NICs (every byte into every node)"),
                 (S / lk["nvlink_bcast_Bps"], "NVLink (every byte into every GPU)")]
        inter = en["nodes"]
        intra = n_gpu - en["nodes"]
        latency = inter * lk["hop_latency_inter_s"] + intra * lk["hop_latency_intra_s"]
    elif design == "many2many":
        per_gpu = E / G + D / en["attn_tp"]
        total_sent = n_eng * (E + D * G / en["attn_tp"])
        sent = total_sent / P
        egress = nic * tr["gpus_per_node"] / publishers_per_node  # the node's NICs, shared
        cands = [(sent / egress, "publisher NICs (each shard to every engine needing it)"),
                 (per_gpu / nic, "engine GPU NIC (its own shard)")]
        if publishers_per_node < tr["gpus_per_node"]:
            # What leaves through the other GPUs' NICs crosses the publisher's NVLink first.
            away = sent * (1.0 - publishers_per_node / tr["gpus_per_node"])
            cands.append((away / lk["nvlink_bcast_Bps"], "publisher GPU NVLink (to the node's NICs)"))
        latency = lk["hop_latency_inter_s"]
    else:
        raise ValueError(design)
    bound, what = max(cands)
    link = Link(share / bound, latency_s=latency)
    q = dict(p)
    # Every engine decodes the requests of every publisher, one at a time.
    q["engine_decode_per_entry_s"] = p["engine_decode_per_entry_s"] * P
    q["engine_checksum_Bps"] = p["engine_checksum_Bps"] * lk["hbm"][en["gpu"]]
    gpus_per_pub = tr["gpus_per_node"] / publishers_per_node
    stages = publish(q, shapes.plan_buckets(mine, bucket_bytes), link, check_first=check_first,
                     lanes=lanes, inputs=len(mine), hbm_scale=lk["hbm"][tr["gpu"]],
                     remote_fraction=1.0 - 1.0 / gpus_per_pub,
                     peer_read_Bps=lk["nvlink_peer_read_Bps"], rtt_s=lk["http_rtt_s"])
    c = number(coord["per_publication_s"]) + number(coord["per_publisher_s"]) * P \
        if P > 1 else 0.0
    ingest = len(mine) * number(data["client"]["ipc_describe_per_tensor_s"]["value"])
    return Result(design, P, S, per_gpu, sent, bound, what, stages, c, ingest,
                  stages.wall + c)

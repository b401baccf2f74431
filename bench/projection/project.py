#!/usr/bin/python3
"""wpub publication model: validation against the runs measured here, projections at scale.

Usage (Debian's Python: standard library and yaml):
  /usr/bin/python3 bench/projection/project.py --self-check     validation; exit 1 if a
                                                                 prediction is off by > tolerance
  /usr/bin/python3 bench/projection/project.py --report FILE    the whole report as markdown
  /usr/bin/python3 bench/projection/project.py                  the report on stdout
Inputs: bench/projection/inputs.yaml (every measured figure cites its line of bench/RESULTS.md).
"""

import argparse
import copy
import os
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cluster  # noqa: E402
import shapes  # noqa: E402
import validate  # noqa: E402
from validate import number  # noqa: E402

MODELS = ["qwen3_235b_a22b", "deepseek_v3", "glm5", "kimi_k2"]
NAMES = {"qwen3_235b_a22b": "Qwen3-235B-A22B", "deepseek_v3": "DeepSeek-V3", "glm5": "GLM-5",
         "kimi_k2": "Kimi-K2"}
LAYOUTS = ["perplexity", "miles", "checkpoint_engine", "nemo_rl", "users_small", "users_large"]


def load(path=None):
    with open(path or os.path.join(HERE, "inputs.yaml")) as f:
        return yaml.safe_load(f)


def shape_checks(data):
    """(model, params, published, error): the shapes against the published parameter counts."""
    out = []
    for m in MODELS:
        cfg = dict(data["models"][m])
        pub = cfg["published_params"]
        if pub.get("excluding_mtp"):
            cfg["mtp_layers"] = 0
        t = shapes.totals(shapes.model_units(cfg))
        ref = number(pub["value"])
        out.append((m, t.params, ref, t.params / ref - 1.0))
    return out


def self_check(data):
    tol = number(data["tolerance"])
    rows = validate.run(data)
    print(validate.table(rows, tol))
    bad = [r for r in rows if r[3] is not None and abs(r[3]) > tol]
    for m, got, ref, err in shape_checks(data):
        print("shape %-16s %.4g parameters, published %.4g (%+.1f%%)" % (m, got, ref, err * 100))
        if abs(err) > 0.02:
            bad.append((m,))
    if bad:
        print("FAILED: %d outside the tolerance" % len(bad))
        return 1
    print("OK: %d runs within %d%%, %d shapes within 2%%"
          % (sum(1 for r in rows if r[3] is not None), round(tol * 100), len(MODELS)))
    return 0


def gb(x):
    return "%.1f" % (x / 1e9)


def inventory_md(data):
    out = ["| model | parameters (MTP included where the config has it) | bf16 in (GB) | wire, NVFP4 experts (GB) | of which experts (GB) |"
           " units | request names | shape source |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for m in MODELS:
        cfg = data["models"][m]
        t = shapes.totals(shapes.model_units(cfg))
        out.append("| %s | %.3g | %s | %s | %s | %d | %d | %s |" % (
            NAMES[m], t.params, gb(t.in_bytes), gb(t.out_bytes), gb(t.out_bytes_expert), t.units,
            t.entries, cfg["src"].split(" config.json")[0] + " config.json"))
    return "\n".join(out)


def layouts_md(data):
    out = ["| layout | trainer | engines | why |", "|---|---|---|---|"]
    for name in LAYOUTS:
        lay = data["layouts"][name]
        tr, en = lay["trainer"], lay["engine"]
        out.append("| %s | %d x %d %s | %d x %d %s, engines of %d GPUs (EP %d, attention TP %d) | "
                   "%s%s |" % (name, tr["nodes"], tr["gpus_per_node"], tr["gpu"], en["nodes"],
                               en["gpus_per_node"], en["gpu"], en["gpus_per_engine"],
                               en["gpus_per_engine"], en["attn_tp"], lay["why"],
                               ("; " + lay["engine_assumption"]) if "engine_assumption" in lay
                               else ""))
    return "\n".join(out)


def anchors_for(data, model, layout):
    return [a for a in data["anchors"] if a["model"] == model and a["layout"] == layout]


def anchor_text(a):
    hi = a.get("seconds_high")
    return "%s %s s" % (a["name"], ("%.1f-%.1f" % (a["seconds"], hi)) if hi else a["seconds"])


def projections_md(data):
    out = ["| model | layout | broadcast, 1 publisher per node (s) | its link bound | "
           "broadcast, 8 per node (s) | many-to-many, 1 per node (s) | many-to-many, 8 per node (s)"
           " | its link bound | per engine GPU: broadcast / sharded (GB) | describe, 1 / 8 per node (s) |"
           " anchors |", "|---|---|---:|---|---:|---:|---:|---|---|---|---|"]
    for m in MODELS:
        for name in LAYOUTS:
            lay = data["layouts"][name]
            b1 = cluster.project(data, m, lay, "broadcast", publishers_per_node=1)
            b8 = cluster.project(data, m, lay, "broadcast", publishers_per_node=8)
            m1 = cluster.project(data, m, lay, "many2many", publishers_per_node=1)
            m8 = cluster.project(data, m, lay, "many2many", publishers_per_node=8)
            anc = "; ".join(anchor_text(a) for a in anchors_for(data, m, name)) or "-"
            out.append("| %s | %s | %.2f | %.2f s: %s | %.2f | %.2f | %.2f | %.2f s: %s | %s / %s | "
                       "%.2f / %.2f | %s |" % (
                           NAMES[m], name, b1.wall_s, b1.bound_s, b1.bound_what, b8.wall_s,
                           m1.wall_s, m8.wall_s, m8.bound_s, m8.bound_what,
                           gb(b1.per_engine_gpu_bytes), gb(m8.per_engine_gpu_bytes), b1.ingest_s,
                           b8.ingest_s, anc))
    return "\n".join(out)


def anchors_md(data):
    """Each anchor's own design and wire format through the model: the link bound it had."""
    out = ["| anchor | model, layout | design, wire (assumed) | bytes into each engine GPU (GB) |"
           " link bound (s) | model (s) | published (s) | published / model |",
           "|---|---|---|---:|---:|---:|---:|---:|"]
    for a in data["anchors"]:
        lay = data["layouts"][a["layout"]]
        r = cluster.project(data, a["model"], lay, a["design"], wire=a["wire"],
                            publishers_per_node=8 if a["design"] == "many2many" else 1)
        pub = a["seconds"]
        out.append("| %s | %s, %s | %s, %s | %s | %.2f | %.2f | %s | %.2fx |" % (
            a["name"], NAMES[a["model"]], a["layout"], a["design"], a["wire"],
            gb(r.per_engine_gpu_bytes), r.bound_s, r.wall_s,
            ("%.1f-%.1f" % (pub, a["seconds_high"])) if a.get("seconds_high") else pub,
            pub / r.wall_s))
    return "\n".join(out)


def stages_row(label, r):
    s = r.stages
    return "| %s | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.3f | %.1f |" % (
        label, r.publishers, s.buckets, s.setup * 1e3, s.amax_check * 1e3, s.first_bucket * 1e3,
        s.transfer * 1e3, max(0.0, s.stalls) * 1e3, (s.tail + s.commit) * 1e3,
        r.coordination_s * 1e3, r.wall_s, r.ingest_s * 1e3)


STAGE_HEAD = ("| case | publishers | buckets per publisher | setup ms | amax + check ms | first bucket"
              " ms | transfer ms | stalls ms | tail + commit ms | coordination ms (PLACEHOLDER) |"
              " publication s | describe ms (before Commit) |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def where_md(data):
    out = [STAGE_HEAD]
    cases = [("qwen3_235b_a22b", "users_small"), ("deepseek_v3", "nemo_rl"),
             ("glm5", "users_large"), ("kimi_k2", "perplexity")]
    for m, name in cases:
        lay = data["layouts"][name]
        for design, ppn, pipelined in [("broadcast", 1, False), ("broadcast", 1, True),
                                       ("many2many", 1, False), ("many2many", 8, False),
                                       ("many2many", 8, True)]:
            r = cluster.project(data, m, lay, design, publishers_per_node=ppn,
                                check_first=not pipelined)
            label = "%s on %s: %s, %d/node%s" % (NAMES[m], name, design, ppn,
                                                 ", amax pipelined" if pipelined else "")
            out.append(stages_row(label, r))
    return "\n".join(out)


def kimi_ladder_md(data):
    """From today's code to under 1.3 s, one change at a time (Perplexity's layout)."""
    lay = data["layouts"]["perplexity"]
    m = "kimi_k2"
    one = dict(lay, trainer=dict(lay["trainer"], nodes=1))
    steps = [
        ("one publisher (today's code; hypothetical: 2.05 TB of bf16 fits no 8-GPU node)",
         cluster.project(data, m, one, "broadcast")),
        ("one publisher per trainer node, broadcast (needs the several-publisher commit)",
         cluster.project(data, m, lay, "broadcast")),
        ("+ a publisher per trainer GPU (8 per node)",
         cluster.project(data, m, lay, "broadcast", publishers_per_node=8)),
        ("sharded many-to-many, 1 publisher per node (all 8 NICs)",
         cluster.project(data, m, lay, "many2many")),
        ("sharded many-to-many, 8 publishers per node",
         cluster.project(data, m, lay, "many2many", publishers_per_node=8)),
        ("  the same with the amax pipelined (a')",
         cluster.project(data, m, lay, "many2many", publishers_per_node=8, check_first=False)),
        ("  the same with SGLang's one request in flight",
         cluster.project(data, m, lay, "many2many", publishers_per_node=8, lanes=1)),
        ("  the same, FP8 on the wire (the anchor's engine format, not wpub's NVFP4)",
         cluster.project(data, m, lay, "many2many", publishers_per_node=8, wire="fp8")),
    ]
    fast = copy.deepcopy(data)
    fast["links"]["nic_Bps"]["value"] = 1.0e11
    steps += [
        ("with 800 Gb/s NICs (assumption): broadcast, 8 publishers per node",
         cluster.project(fast, m, lay, "broadcast", publishers_per_node=8)),
        ("with 800 Gb/s NICs (assumption): many-to-many, 8 publishers per node",
         cluster.project(fast, m, lay, "many2many", publishers_per_node=8)),
    ]
    out = ["| change | publishers | bytes into each engine GPU (GB) | sent per publisher (GB) |"
           " link bound (s) | bound by | publication (s) | + describe (s) |",
           "|---|---:|---:|---:|---:|---|---:|---:|"]
    for label, r in steps:
        out.append("| %s | %d | %s | %s | %.2f | %s | %.2f | %.2f |" % (
            label, r.publishers, gb(r.per_engine_gpu_bytes), gb(r.per_publisher_sent), r.bound_s,
            r.bound_what, r.wall_s, r.wall_s + r.ingest_s))
    return "\n".join(out)


def sweep_md(data):
    """Bucket size and NIC rate at scale (Kimi-K2, Perplexity's layout, many-to-many 8/node)."""
    lay = data["layouts"]["perplexity"]
    out = ["| bucket | broadcast 1/node (s) | many-to-many 8/node (s) | many-to-many, 1 in flight (s) |",
           "|---|---:|---:|---:|"]
    for mib in (64, 256, 1024, 4096):
        bb = mib << 20
        b = cluster.project(data, "kimi_k2", lay, "broadcast", bucket_bytes=bb)
        mm = cluster.project(data, "kimi_k2", lay, "many2many", publishers_per_node=8, bucket_bytes=bb)
        m1 = cluster.project(data, "kimi_k2", lay, "many2many", publishers_per_node=8,
                             bucket_bytes=bb, lanes=1)
        out.append("| %d MiB | %.3f | %.3f | %.3f |" % (mib, b.wall_s, mm.wall_s, m1.wall_s))
    return "\n".join(out)


def report(data):
    tol = number(data["tolerance"])
    parts = [
        "<!-- generated by /usr/bin/python3 bench/projection/project.py from"
        " bench/projection/inputs.yaml -->",
        "## Validation: the runs measured here\n",
        validate.table(validate.run(data), tol),
        "\nShapes against the published parameter counts: " + "; ".join(
            "%s %.4g (%+.1f%%)" % (NAMES[m], got, err * 100)
            for m, got, _, err in shape_checks(data)) + ".",
        "\n## Models\n", inventory_md(data),
        "\n## Layouts\n", layouts_md(data),
        "\n## Projections: broadcast vs sharded many-to-many vs the anchors\n", projections_md(data),
        "\n## The anchors through the model (their design and wire format)\n", anchors_md(data),
        "\n## Where the time goes\n", where_md(data),
        "\n## Kimi-K2 under 1.3 s (Perplexity's layout)\n", kimi_ladder_md(data),
        "\n## Bucket size at scale (Kimi-K2, Perplexity's layout)\n", sweep_md(data),
    ]
    return "\n".join(parts) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", default=None)
    ap.add_argument("--self-check", action="store_true")
    ap.add_argument("--report", default=None, help="write the markdown report to this file")
    a = ap.parse_args()
    data = load(a.inputs)
    if a.self_check:
        return self_check(data)
    text = report(data)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

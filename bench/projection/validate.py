"""The runs measured here, predicted by the model (inputs.yaml `validation`)."""

import shapes
from pipeline import Link, broadcast_only, publish

GIB = 1 << 30


def number(v):
    """YAML 1.1 reads 2.44e12 (no exponent sign) as a string: accept it as a number."""
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def values(section):
    """{name: value} of a section whose entries are numbers or {value, src} maps."""
    return {k: number(v["value"] if isinstance(v, dict) and "value" in v else v)
            for k, v in section.items()}


def bench_units(data):
    return shapes.model_units(data["models"]["qwen3_30b_bench"])


def predict_gpu(data, case, units):
    p = values(data["profiles"][case["profile"]])
    bucket = case.get("bucket_mib", 1024) * (1 << 20)
    lanes = case.get("lanes")
    inputs = len(units)
    mode = case["case"]
    if mode == "d":  # the plain broadcast of 17 x 1 GiB messages
        n = -(-shapes.totals(units).out_bytes // GIB)
        return broadcast_only([shapes.Bucket(out_bytes=GIB)] * n, Link(p["bcast_Bps"]))
    if mode in ("b", "e_bf16"):
        units = shapes.bf16_all(units)
    buckets = shapes.plan_buckets(units, bucket)
    if mode.startswith("e_"):
        return publish(p, buckets, Link(p["bcast_Bps"]), inputs=inputs, engine=False).wall
    pipelined = mode == "a_pipelined"
    slow = p["bcast_beside_amax_slowdown"] if pipelined else p["bcast_beside_slowdown"]
    link = Link(p["bcast_Bps"], beside_slowdown=slow)
    return publish(p, buckets, link, check_first=not pipelined, lanes=lanes, inputs=inputs).wall


def predict_cpu(data, case):
    c = values(data["cpu_path"])
    ingest = c["in_bytes"] / c["ingest_inline_Bps"] if case["source"] == "inline" \
        else c["ingest_shm_s"]
    return (ingest + c["expert_in_bytes"] / c["quantize_Bps"] + c["out_bytes"] / c["pack_Bps"]
            + c["transfer_s"] + c["commit_s"])


def run(data):
    """Rows of (name, measured, predicted, error or None, src)."""
    units = bench_units(data)
    rows = []
    for case in data["validation"]:
        if case["kind"] == "none":
            rows.append((case["name"], None, None, None, case["src"]))
            continue
        pred = predict_cpu(data, case) if case["kind"] == "cpu" else predict_gpu(data, case, units)
        err = pred / case["measured"] - 1.0
        rows.append((case["name"], case["measured"], pred, err, case["src"]))
    return rows


def table(rows, tolerance):
    out = ["| run | measured s | predicted s | error | within %d%% | source |" % round(tolerance * 100),
           "|---|---:|---:|---:|---|---|"]
    for name, m, pr, err, src in rows:
        if m is None:
            out.append("| %s | - | - | - | n/a | %s |" % (name, src))
            continue
        ok = "yes" if abs(err) <= tolerance else "**NO**"
        out.append("| %s | %.4g | %.4g | %+.1f%% | %s | %s |" % (name, m, pr, err * 100, ok, src))
    return "\n".join(out)

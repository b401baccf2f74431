#!/usr/bin/env python3
"""Checks a `wpubctl convert` output the way a rollout engine would read it.

Loads every shard with the `safetensors` library when it is importable (with torch, as SGLang and
vLLM do), else with a standard-library header parser and numpy memory maps; checks the index,
`format: pt` metadata, config.json / hf_quant_config.json, the modelopt NVFP4 tensor layout, and
for sampled quantized weights recomputes standard NVFP4 (docs/specs/nvfp4.md) with an
independent vectorized numpy quantizer from the INPUT checkpoint and compares bytes: packed
codes, E4M3 block scales, weight_scale_2, input_scale. It also decodes the weights
(code x scale x scale_2, the engines' formula) and reports the error against the input.

Usage: check_output.py --input IN_DIR --output OUT_DIR [--samples N] [--mode nvfp4|other]
                       [--require-safetensors]
Exit status 0 when every check passes.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

try:
    import torch  # noqa: F401
    from safetensors import safe_open
    HAVE_ST = True
except ImportError:
    HAVE_ST = False

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max
ONE6 = np.array([0x3E2AAAAB], dtype=np.uint32).view(np.float32)[0]
NP_DTYPE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U8": np.uint8,
            "F8_E4M3": np.uint8, "I64": np.int64, "I32": np.int32, "F64": np.float64,
            "I8": np.int8, "BOOL": np.uint8}


def header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


class Shard:
    """One safetensors file: name -> (dtype, shape, raw uint8 bytes)."""

    def __init__(self, path):
        self.path = path
        self.head, self.start = header(path)
        self.meta = self.head.pop("__metadata__", {})
        if HAVE_ST:
            self.f = safe_open(path, framework="pt")
            assert set(self.f.keys()) == set(self.head), path
            assert (self.f.metadata() or {}) == self.meta, path
        else:
            self.mm = np.memmap(path, dtype=np.uint8, mode="r")

    def raw(self, name):
        info = self.head[name]
        if HAVE_ST:
            import torch
            t = self.f.get_tensor(name).contiguous()
            assert list(t.shape) == info["shape"], name
            # reshape first: torch refuses a dtype view of a 0-d tensor with another item size.
            return t.reshape(-1).view(torch.uint8).numpy()
        b, e = info["data_offsets"]
        return np.asarray(self.mm[self.start + b:self.start + e])

    def array(self, name):
        info = self.head[name]
        a = self.raw(name).view(NP_DTYPE[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


class Checkpoint:
    def __init__(self, d):
        self.dir = d
        idx = os.path.join(d, "model.safetensors.index.json")
        if os.path.exists(idx):
            self.index = json.load(open(idx))
            files = sorted(set(self.index["weight_map"].values()))
        else:
            self.index = None
            files = ["model.safetensors"]
        self.shards = {f: Shard(os.path.join(d, f)) for f in files}
        self.where = {n: f for f, s in self.shards.items() for n in s.head}

    def array(self, name):
        return self.shards[self.where[name]].array(name)

    def raw(self, name):
        return self.shards[self.where[name]].raw(name)


# E4M3 positive finite values by code 0..126, for nearest-even rounding by search.
def _e4m3_table():
    vals = []
    for c in range(127):
        e, m = c >> 3, c & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10))
    return np.array(vals, dtype=np.float64)


E4M3 = _e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)


def e4m3_code(s):
    """Non-negative float32 -> E4M3 code, round to nearest even, saturating at 448."""
    s = s.astype(np.float64)
    hi = np.clip(np.searchsorted(E4M3, s), 1, 126)
    lo = hi - 1
    dlo, dhi = s - E4M3[lo], E4M3[hi] - s
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(s >= 448, 126, code).astype(np.uint8)


def e2m1_code(v):
    a = np.abs(v)
    c = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0],
                  [0, 1, 2, 3, 4, 5, 6], 7).astype(np.uint8)
    c = np.where(np.isnan(v), 7, c | np.where(np.signbit(v), 8, 0)).astype(np.uint8)
    return c


def reference_nvfp4(x, amax):
    """Standard NVFP4 of x [M, K] (float32) with a given global amax."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s_enc = np.minimum(F32(2688.0) / F32(amax), FLT_MAX).astype(F32)
        s_enc = F32(1.0) if s_enc == 0 else s_enc
        s_dec = F32(F32(1.0) / s_enc)
        blocks = x.reshape(-1, 16)
        bmax = np.max(np.where(np.isnan(blocks), F32(0), np.abs(blocks)), axis=1).astype(F32)
        mult = F32(s_enc * ONE6)
        s = np.minimum((bmax * mult).astype(F32), FLT_MAX)
        sf = e4m3_code(s)
        sfv = E4M3[sf].astype(F32)
        inv = np.minimum((F32(1.0) / (sfv * s_dec).astype(F32)).astype(F32), FLT_MAX)
        q = e2m1_code((blocks * inv[:, None]).astype(F32))
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    return packed, sf, s_dec


def partner(name):
    for a, b in ((".gate_proj.weight", ".up_proj.weight"), (".up_proj.weight", ".gate_proj.weight"),
                 (".w1.weight", ".w3.weight"), (".w3.weight", ".w1.weight")):
        if name.endswith(a):
            return name[: -len(a)] + b
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--mode", default="nvfp4", help="nvfp4: compare bytes; else layout only")
    ap.add_argument("--require-safetensors", action="store_true",
                    help="fail unless the safetensors library (with torch) reads the files")
    args = ap.parse_args()
    if args.require_safetensors and not HAVE_ST:
        sys.exit("the safetensors library (with torch) is not importable here")
    print(f"loader: {'safetensors ' + __import__('safetensors').__version__ if HAVE_ST else 'stdlib+numpy'}")

    out, inp = Checkpoint(args.output), Checkpoint(args.input)
    assert out.index is not None, "model.safetensors.index.json missing"
    for f, s in out.shards.items():
        assert s.meta == {"format": "pt"}, (f, s.meta)
    wm = out.index["weight_map"]
    assert set(wm) == set(out.where), "index weight_map != tensors"
    assert all(out.where[n] == f for n, f in wm.items()), "index maps a tensor to a wrong shard"
    total = sum(e["data_offsets"][1] - e["data_offsets"][0]
                for s in out.shards.values() for e in s.head.values())
    assert out.index["metadata"]["total_size"] == total, "index total_size"
    qc = json.load(open(os.path.join(args.output, "config.json")))["quantization_config"]
    # NVFP4 (W4A4: input_scale per module) or W4A16_NVFP4 (weight-only: none).
    algo = qc["quant_algo"]
    assert algo in ("NVFP4", "W4A16_NVFP4"), algo
    assert qc["quant_method"] == "modelopt" and qc["group_size"] == 16
    hq = json.load(open(os.path.join(args.output, "hf_quant_config.json")))
    assert hq["producer"]["name"] == "modelopt" and hq["quantization"]["quant_algo"] == algo
    assert hq["quantization"]["exclude_modules"] == qc["ignore"]
    # What vLLM's ModelOpt NVFP4 reader requires of the nested format (group_size,
    # kv_cache_quant_algo, exclude_modules as keys; kv_cache_quant_algo null or a string) and
    # older SGLang indexes directly; the producer names its version.
    for key in ("group_size", "kv_cache_quant_algo", "exclude_modules"):
        assert key in hq["quantization"], f"hf_quant_config.json lacks quantization.{key}"
    assert hq["quantization"]["kv_cache_quant_algo"] is None
    assert isinstance(hq["quantization"]["exclude_modules"], list)
    assert hq["producer"].get("version"), "hf_quant_config.json producer has no version"
    assert "kv_cache_quant_algo" in qc and qc["kv_cache_quant_algo"] is None

    quantized = sorted(n[: -len("_scale_2")] for n in out.where if n.endswith(".weight_scale_2"))
    kept = [n for n in inp.where if n not in quantized]
    for n in kept:
        assert np.array_equal(out.raw(n), inp.raw(n)), f"kept tensor {n} changed"
    print(f"{len(out.shards)} shards, {len(quantized)} quantized, {len(kept)} kept (bytes equal)")
    for n in quantized:
        h = out.shards[out.where[n]].head
        ih = inp.shards[inp.where[n]].head[n]
        k = ih["shape"][-1]
        assert h[n]["dtype"] == "U8" and h[n]["shape"] == ih["shape"][:-1] + [k // 2], n
        assert h[n + "_scale"]["dtype"] == "F8_E4M3", n
        assert h[n + "_scale"]["shape"] == ih["shape"][:-1] + [k // 16], n
        base = n[: -len(".weight")]
        if algo == "NVFP4":
            assert out.array(base + ".input_scale").reshape(-1).tolist() == [1.0], n
        else:
            assert base + ".input_scale" not in out.where, n

    # Samples: spread over the list, plus every pair whose halves sit in different shards.
    picks = set(quantized[:: max(1, len(quantized) // max(1, args.samples))][: args.samples])
    for n in quantized:
        p = partner(n)
        if p and p in inp.where and inp.where[p] != inp.where[n]:
            picks.add(n)
    worst = 0.0
    for n in sorted(picks):
        x = inp.array(n)
        if x.ndim != 2:
            continue
        p = partner(n)
        amax = np.max(np.abs(np.nan_to_num(x, nan=0.0)))
        if p and p in inp.where:
            amax = max(amax, np.max(np.abs(np.nan_to_num(inp.array(p), nan=0.0))))
        packed = out.raw(n)
        scales = out.raw(n + "_scale")
        s2 = out.array(n + "_scale_2").reshape(-1)[0]
        if args.mode == "nvfp4":
            rp, rs, rs2 = reference_nvfp4(x, F32(amax))
            assert np.array_equal(packed, rp), f"{n}: packed codes differ from the numpy reference"
            assert np.array_equal(scales, rs), f"{n}: block scales differ from the numpy reference"
            assert F32(s2).tobytes() == rs2.tobytes(), f"{n}: weight_scale_2 {s2} != {rs2}"
        codes = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)
        vals = np.where(codes & 8, -1, 1) * E2M1[codes & 7]
        dec = (vals.reshape(-1, 16) * (E4M3[scales].astype(F32) * F32(s2))[:, None]).reshape(x.shape)
        err = float(np.mean(np.abs(dec - x)) / max(1e-30, float(np.mean(np.abs(x)))))
        worst = max(worst, err)
        assert err < 0.2, f"{n}: decoded weights far from the input (mean rel err {err:.3f})"
    print(f"checked {len(picks)} quantized tensors against the numpy reference "
          f"({'bytes + ' if args.mode == 'nvfp4' else ''}decode); worst mean rel decode error {worst:.4f}")
    print("OK")


if __name__ == "__main__":
    sys.exit(main())

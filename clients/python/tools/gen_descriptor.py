#!/usr/bin/env python3
"""Regenerates wpub/wpub_v1.binpb, the serialized FileDescriptorSet of proto/wpub/v1/*.proto
that the package builds its message classes from (see wpub/_proto.py).

Usage: gen_descriptor.py [--proto_dir DIR] [--protoc PATH] [--out FILE] [--check]
--check compares a fresh set with the embedded one and exits 1 when they differ (stale file).
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PROTO_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "..", "proto"))
DEFAULT_OUT = os.path.normpath(os.path.join(HERE, "..", "wpub", "wpub_v1.binpb"))


def generate(proto_dir: str, protoc: str, out: str) -> None:
    """Runs protoc over every proto/wpub/v1/*.proto into `out` (no source info, so the bytes
    depend only on the .proto contents)."""
    files = sorted(glob.glob(os.path.join(proto_dir, "wpub", "v1", "*.proto")))
    if not files:
        raise FileNotFoundError(f"no wpub/v1/*.proto under '{proto_dir}'")
    rel = [os.path.relpath(f, proto_dir) for f in files]
    subprocess.run([protoc, f"--proto_path={proto_dir}", "--include_imports",
                    f"--descriptor_set_out={out}", *rel], check=True)


def canonical(path: str) -> bytes:
    """The set's files sorted by name and re-serialized deterministically (protoc versions may
    order --include_imports output differently)."""
    from google.protobuf import descriptor_pb2
    fds = descriptor_pb2.FileDescriptorSet()
    with open(path, "rb") as f:
        fds.ParseFromString(f.read())
    files = sorted(fds.file, key=lambda f: f.name)
    return b"".join(f.SerializeToString(deterministic=True) for f in files)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--proto_dir", default=DEFAULT_PROTO_DIR)
    ap.add_argument("--protoc", default=shutil.which("protoc") or "protoc")
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if not args.check:
        generate(args.proto_dir, args.protoc, args.out)
        print(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = os.path.join(tmp, "fresh.binpb")
        generate(args.proto_dir, args.protoc, fresh)
        if canonical(fresh) != canonical(args.out):
            print(f"{args.out} is stale: rerun {os.path.relpath(__file__)}", file=sys.stderr)
            return 1
    print(f"{args.out} matches {args.proto_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# The publication-group CPU benchmark (bench/group/group_bench.py) on a GPU host's CPUs (16
# cores: the daemons, receiver and Python members each get a core), with the binaries staged in
# .devbin/group (deploy/stage_devbin.sh build group server/wpubd/wpubd clients/recv/wpub-recv).
# Writes group_bench.json and the log to $OUT.
set -u
ROOT=$(pwd)
OUT=${OUT:-/tmp/wpub_group_bench_out}
mkdir -p "$OUT"
BIN=$ROOT/.devbin/group
if [[ ! -d $BIN && -f $BIN.tgz ]]; then tar -xzf "$BIN.tgz" -C "$(dirname "$BIN")"; fi
WRAP=$(mktemp -d /tmp/wpub_wrap.XXXXXX)
for b in wpubd wpub-recv; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s" exec "%s" "$@"\n' "$BIN/lib:${LD_LIBRARY_PATH:-}" "$BIN/$b" >"$WRAP/$b"
  chmod +x "$WRAP/$b"
done
nproc
PYTHONPATH=$ROOT/clients/python WPUBD=$WRAP/wpubd WPUB_RECV=$WRAP/wpub-recv \
  timeout 500 python3 "$ROOT/bench/group/group_bench.py" --json "$OUT/group_bench.json" "$@" \
  2>&1 | tee "$OUT/group_bench.log"

#!/usr/bin/env bash
# Makes a relocatable tarball of wpub's binaries for hosts without the build dependencies:
#   deploy/bundle.sh [BUILD_DIR] [OUTPUT.tar.gz]     (defaults: build, wpub-<version>-<arch>.tar.gz)
# Layout: bin/ (wrapper scripts that set LD_LIBRARY_PATH to ../lib and exec the real binary),
# libexec/ (the binaries), lib/ (every shared library they load that is not part of glibc or
# the NVIDIA driver, as ldd resolves them on this build host). The driver (libcuda,
# libnvidia-*) must come from the target host; so must glibc (this build's or newer).
set -euo pipefail

build_dir=${1:-build}
version=${WPUB_VERSION:-0.1.0}
arch=$(uname -m)
name="wpub-${version}-${arch}"
output=${2:-$PWD/${name}.tar.gz}
case "$output" in /*) ;; *) output="$PWD/$output" ;; esac

declare -A binaries=(
  [wpubd]="$build_dir/server/wpubd/wpubd"
  [wpubctl]="$build_dir/server/wpubctl/wpubctl"
  [wpub-recv]="$build_dir/clients/recv/wpub-recv"
)
for b in "${!binaries[@]}"; do
  if [ ! -x "${binaries[$b]}" ]; then
    echo "bundle: ${binaries[$b]} is missing: build it first (cmake --build $build_dir)" >&2
    exit 1
  fi
done

# Libraries the target host provides: glibc's own and the NVIDIA driver's (which must match
# the host's kernel module).
is_system_lib() {
  case "$(basename "$1")" in
    linux-vdso.so.*|ld-linux*.so.*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*) return 0 ;;
    libresolv.so.*|libutil.so.*|libanl.so.*|libnsl.so.*|libmvec.so.*) return 0 ;;
    libcuda.so.*|libnvidia-*.so.*|libnvcuvid.so.*) return 0 ;;
  esac
  return 1
}

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/$name"
mkdir -p "$root/bin" "$root/libexec" "$root/lib"

for b in "${!binaries[@]}"; do
  install -m 0755 "${binaries[$b]}" "$root/libexec/$b"
  # ldd lists the whole closure (direct and indirect dependencies).
  while read -r lib; do
    [ -n "$lib" ] || continue
    if is_system_lib "$lib"; then continue; fi
    if [ ! -e "$root/lib/$(basename "$lib")" ]; then
      cp -L "$lib" "$root/lib/$(basename "$lib")"
      chmod 0644 "$root/lib/$(basename "$lib")"
    fi
  done < <(ldd "${binaries[$b]}" | awk '/=> \// { print $3 } /^\t\// { print $1 }')
  if ldd "${binaries[$b]}" | grep -q "not found"; then
    echo "bundle: ${binaries[$b]} has unresolved libraries:" >&2
    ldd "${binaries[$b]}" | grep "not found" >&2
    exit 1
  fi
done

# The wrappers find the bundle from their own location, so it works wherever it is unpacked.
# wpubctl demo starts wpubd and wpub-recv from the bundle rather than from a build tree.
for b in "${!binaries[@]}"; do
  extra=""
  if [ "$b" = wpubctl ]; then
    extra='if [ "${1:-}" = demo ]; then
  shift
  set -- demo --wpubd_path="$root/libexec/wpubd" --recv_path="$root/libexec/wpub-recv" "$@"
fi'
  fi
  cat > "$root/bin/$b" <<WRAPPER
#!/bin/sh
# $b from the relocatable wpub bundle: its shared libraries are in ../lib.
root=\$(cd "\$(dirname "\$0")/.." && pwd)
LD_LIBRARY_PATH="\$root/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# Bounded glibc malloc arenas: RSS stays flat over many publications (server/README.md).
MALLOC_ARENA_MAX="\${MALLOC_ARENA_MAX:-2}"
export LD_LIBRARY_PATH MALLOC_ARENA_MAX
$extra
exec "\$root/libexec/$b" "\$@"
WRAPPER
  chmod 0755 "$root/bin/$b"
done

here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$root/share/wpub"
cp -r "$here/systemd" "$here/prometheus" "$here/grafana" "$root/share/wpub/"
# The Python client as a wheel for the trainer's host (python/wpub-<version>-py3-none-any.whl),
# built offline from clients/python as CI builds it (the tree is left unchanged).
py=/usr/bin/python3
[ -x "$py" ] || py=python3
if "$py" -c "import build, wheel, setuptools" 2>/dev/null; then
  "$py" -m build --wheel --no-isolation --outdir "$root/python" "$here/../clients/python" >/dev/null
else
  echo "bundle: python3-build, python3-wheel or python3-setuptools missing: no Python client wheel" >&2
fi
cat > "$root/README" <<EOF2
wpub $version ($arch): relocatable bundle. Unpack anywhere, then run bin/wpubd --help,
bin/wpubctl demo. share/wpub holds the systemd unit, the Prometheus scrape config and the
Grafana dashboard; python/ the trainer's client (pip install python/wpub-*.whl). Needs glibc as
new as the build host's and, for the GPU path, the NVIDIA driver.
EOF2
(cd "$root" && find libexec lib -type f | sort | xargs sha256sum > SHA256SUMS)
tar -C "$stage" -czf "$output" "$name"
echo "$output"

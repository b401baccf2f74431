"""Client-side checks of the Publisher's arguments (target, version, token file, TLS files,
engines) and the publication header they build: a mistake is an InvalidArgument (or
ValueError for the TLS files) naming the argument, raised before anything is sent."""

import json
import numbers
import warnings
from typing import Any, Iterable, List, Optional, Tuple

import grpc

from . import errors
from ._proto import pb

_MAX_VERSION = (1 << 64) - 1  # the wire's uint64
DEFAULT_TARGET = "127.0.0.1:50151"  # wpubd's default --listen

POLICY_FIELDS = ("extra_high_precision_layers_megatron", "extra_high_precision_layers_hf",
                 "first_last_layers_bf16", "num_layers", "num_layers_at_start_in_bf16",
                 "num_layers_at_end_in_bf16", "allow_nothing_quantized")


def check_target(target: Any) -> str:
    """`target` when gRPC can dial it as the user meant, else InvalidArgument saying why:
    "host:port" (port 1-65535, IPv6 hosts in brackets), "unix:/path", "unix-abstract:name" or a
    gRPC URI ("dns:///host:port", "ipv4:...", "ipv6:..."). Catches what gRPC would silently
    misread ("localhost:50161x" dials port 50161) or never reach (no port: 443)."""
    if not isinstance(target, str):
        raise errors.InvalidArgument(f"target must be a str, got {type(target).__name__}")
    if not target or target != target.strip() or any(c.isspace() for c in target):
        raise errors.InvalidArgument(f"target {target!r} is empty or holds whitespace")
    scheme = target.split(":", 1)[0].lower()
    if scheme in ("unix", "unix-abstract"):
        if not target[len(scheme) + 1:].lstrip("/") and scheme == "unix":
            raise errors.InvalidArgument(f"target {target!r}: a unix: target needs a path")
        if not target[len(scheme) + 1:]:
            raise errors.InvalidArgument(f"target {target!r}: a {scheme}: target needs a name")
        return target
    if scheme in ("dns", "ipv4", "ipv6", "vsock") or "://" in target:
        return target  # a gRPC URI: gRPC's own resolver checks it
    if target.startswith("["):
        close = target.find("]")
        host, rest = (target[1:close], target[close + 1:]) if close > 0 else ("", "")
        if not host or not rest.startswith(":"):
            raise errors.InvalidArgument(f"target {target!r}: expected [ipv6-address]:port")
        port = rest[1:]
    else:
        if target.count(":") != 1:
            hint = (" (an IPv6 address goes in brackets: [::1]:50151)" if target.count(":") > 1
                    else f" (wpubd listens on {DEFAULT_TARGET.split(':')[1]} by default)")
            raise errors.InvalidArgument(f"target {target!r}: expected host:port{hint}")
        host, port = target.split(":")
        if not host:
            raise errors.InvalidArgument(f"target {target!r}: the host is empty")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise errors.InvalidArgument(
            f"target {target!r}: port {port!r} is not a number in [1, 65535]")
    return target


def check_version(version: Any) -> int:
    """`version` as an int when it is one in [1, 2^64 - 1], else InvalidArgument (a bool, a
    float or an out-of-range number would otherwise fail inside protobuf)."""
    if isinstance(version, bool) or not isinstance(version, numbers.Integral):
        raise errors.InvalidArgument(
            f"version must be an int, got {type(version).__name__} {version!r}")
    v = int(version)
    if not 1 <= v <= _MAX_VERSION:
        raise errors.InvalidArgument(
            f"version={v} is out of range: versions are in [1, 2^64 - 1] and strictly "
            "increasing (0 means none committed)")
    return v


def read_token_file(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise errors.InvalidArgument(f"token_file '{path}': {why}") from None
    if not token:
        raise errors.InvalidArgument(f"token_file '{path}' is empty")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise errors.InvalidArgument(f"token_file '{path}': the token holds whitespace or "
                                     "control characters (one line, the token alone)")
    return token


def queue_flag(queue_behind_active: bool, wait: Optional[bool]) -> bool:
    """The header's queue flag from publish()'s argument and its deprecated alias."""
    if wait is None:
        return bool(queue_behind_active)
    if queue_behind_active:
        raise TypeError("publish(): pass queue_behind_active only (wait is its deprecated name)")
    warnings.warn("publish(wait=...) is deprecated: use queue_behind_active=...",
                  DeprecationWarning, stacklevel=3)
    return bool(wait)


def build_header(version: int, recipe: str, policy, quantization_config, model_id: str,
            allow_non_finite: bool, queue_behind_active: bool, bucket_bytes: int,
            release_gpu_memory: bool = False):
    h = pb.PublicationHeader(version=version, model_id=model_id, recipe=recipe,
                             allow_non_finite=allow_non_finite, queue=queue_behind_active,
                             bucket_bytes=bucket_bytes, release_gpu_memory=release_gpu_memory)
    if quantization_config is not None:
        h.quantization_config_json = (quantization_config if isinstance(quantization_config, str)
                                      else json.dumps(quantization_config))
    if policy:
        unknown = set(policy) - set(POLICY_FIELDS)
        if unknown:
            raise errors.InvalidArgument(
                f"policy: unknown key(s) {sorted(unknown)} (known: {', '.join(POLICY_FIELDS)})")
        pe = h.precision_exceptions
        for key, value in policy.items():
            if key.startswith("extra_"):
                if isinstance(value, str):
                    value = [value]
                getattr(pe, key).extend(value)
            else:
                setattr(pe, key, value)
    return h


# The engine kinds the daemon speaks (docs/specs/engines.md): over NCCL, and colocated ("-ipc":
# the engine on the daemon's node reads the buckets in its GPU memory through CUDA IPC).
ENGINE_KINDS = ("", "sglang", "vllm", "sglang-ipc", "vllm-ipc")


def engine_entries(engines: Iterable[Any]) -> List[Tuple[str, int, str]]:
    """[(url, gpus, kind)] of connect_engines' `engines` ("url", "url=gpus", (url, gpus) or a
    dict); InvalidArgument naming the entry for a form it does not accept (the daemon checks URLs
    and counts again). kind: "sglang", "vllm", "sglang-ipc", "vllm-ipc" or "" (the URL's
    "<kind>+" prefix decides, default sglang)."""
    if isinstance(engines, (str, bytes, dict)):
        engines = [engines]
    out = []
    for i, e in enumerate(engines):
        gpus: Any = 1
        kind: Any = ""
        if isinstance(e, str):
            # "url=gpus", as wpubd --engines and `wpubctl connect-engines` take them.
            url, eq, count = e.rpartition("=")
            if not eq:
                url = e
            elif count.isdigit():
                gpus = int(count)
            else:
                raise errors.InvalidArgument(
                    f"engines[{i}] {e!r}: after '=' comes the engine's GPU count, e.g. "
                    "'http://engine:30000=2'")
        elif isinstance(e, dict):
            unknown = set(e) - {"url", "gpus", "kind"}
            if "url" not in e or unknown:
                raise errors.InvalidArgument(
                    f"engines[{i}] {e!r}: a dict needs 'url' and may have 'gpus' and 'kind', "
                    "nothing else")
            url, gpus, kind = e["url"], e.get("gpus", 1), e.get("kind", "")
        elif isinstance(e, (tuple, list)) and len(e) == 2:
            url, gpus = e
        else:
            raise errors.InvalidArgument(
                f"engines[{i}] {e!r}: expected a URL, (url, gpus) or {{'url': ..., 'gpus': ...}}")
        if not isinstance(url, str):
            raise errors.InvalidArgument(f"engines[{i}]: the URL must be a str, got "
                                         f"{type(url).__name__}")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 4096:
            raise errors.InvalidArgument(
                f"engines[{i}] '{url}': gpus={gpus!r} must be an int in [1, 4096]")
        if kind not in ENGINE_KINDS:
            raise errors.InvalidArgument(
                f"engines[{i}] '{url}': kind={kind!r} must be one of "
                f"{', '.join(repr(k) for k in ENGINE_KINDS if k)}")
        out.append((url, gpus, kind))
    if not out:
        raise errors.InvalidArgument("engines: no engine given")
    return out


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{what} '{path}': {e.strerror}") from None
    if not data:
        raise ValueError(f"{what} '{path}' is empty")
    return data


def tls_credentials(ca_file: Optional[str], cert_file: Optional[str],
                     key_file: Optional[str]) -> Optional["grpc.ChannelCredentials"]:
    """TLS credentials from PEM files (None: plaintext). ValueError naming the argument."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
    if not ca_file:
        if cert_file:
            raise ValueError("tls_cert_file needs tls_ca_file (the CA of the daemon's certificate)")
        return None
    ca = read_pem(ca_file, "tls_ca_file")
    if not cert_file:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(root_certificates=ca,
                                        private_key=read_pem(key_file, "tls_key_file"),
                                        certificate_chain=read_pem(cert_file, "tls_cert_file"))

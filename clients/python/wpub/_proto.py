"""Message classes of the wpub.v1 wire API, built at import time from a FileDescriptorSet.

No protoc-generated ``_pb2`` modules are shipped: generated code is tied to the protobuf runtime
that generated it, and trainers meet both Debian 12's protobuf (3.21, Python package 4.21) and
current wheels (5.x-7.x). A serialized FileDescriptorSet (the wire format of descriptor.proto,
stable across every protobuf version) is embedded in the package as ``wpub_v1.binpb``; it is
regenerated from ``proto/`` by ``tools/gen_descriptor.py`` (run by ``setup.py`` at build time
when ``protoc`` is available). ``WPUB_DESCRIPTOR_SET`` may point at another file, e.g. one built
by CMake next to the daemon it talks to.
"""

import os
from typing import Dict

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_PACKAGE = "wpub.v1"
_DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wpub_v1.binpb")


def message_class(descriptor):
    """Returns the concrete message class of `descriptor` on any supported protobuf runtime.

    protobuf >= 4.22 (and 5-7) offer ``message_factory.GetMessageClass``; older runtimes
    (Debian 12's 3.21 / Python 4.21.12) only ``MessageFactory().GetPrototype``, which newer
    runtimes removed. Neither API exists in both, hence this shim.
    """
    get = getattr(message_factory, "GetMessageClass", None)
    if get is not None:
        return get(descriptor)
    return message_factory.MessageFactory(descriptor.file.pool).GetPrototype(descriptor)


def load_descriptor_set(path: str = "") -> descriptor_pb2.FileDescriptorSet:
    """Reads the FileDescriptorSet at `path` (default: env WPUB_DESCRIPTOR_SET, then the
    embedded one)."""
    path = path or os.environ.get("WPUB_DESCRIPTOR_SET", "") or _DEFAULT_PATH
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ImportError(
            f"wpub: cannot read the wire-API descriptor set '{path}' ({e}); reinstall the "
            "package or regenerate it with clients/python/tools/gen_descriptor.py") from e
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(data)
    if not any(f.package == _PACKAGE for f in fds.file):
        raise ImportError(f"wpub: descriptor set '{path}' does not define package {_PACKAGE}")
    return fds


def build_messages(fds: descriptor_pb2.FileDescriptorSet) -> Dict[str, type]:
    """Adds `fds` to a private pool (never the default pool, so an application that also
    imports generated wpub modules does not conflict) and returns {short name: class} for
    every message of package wpub.v1."""
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:  # --include_imports lists dependencies before their dependents
        pool.AddSerializedFile(f.SerializeToString())
    classes = {}
    for f in fds.file:
        if f.package != _PACKAGE:
            continue
        for m in f.message_type:
            desc = pool.FindMessageTypeByName(f"{_PACKAGE}.{m.name}")
            classes[m.name] = message_class(desc)
        for e in f.enum_type:
            desc = pool.FindEnumTypeByName(f"{_PACKAGE}.{e.name}")
            classes[e.name] = desc
    return classes


def service_methods(fds: descriptor_pb2.FileDescriptorSet, service: str) -> Dict[str, tuple]:
    """{method name: (input type short name, output type short name, client_streaming,
    server_streaming)} of `service` in package wpub.v1."""
    for f in fds.file:
        if f.package != _PACKAGE:
            continue
        for s in f.service:
            if s.name == service:
                return {
                    m.name: (m.input_type.rsplit(".", 1)[-1], m.output_type.rsplit(".", 1)[-1],
                             m.client_streaming, m.server_streaming) for m in s.method
                }
    return {}


class _Namespace:
    """Attribute access to the message classes (pb.PublishRequest, pb.PublicationReport...)."""

    def __init__(self, classes, methods):
        self.__dict__.update(classes)
        self.publisher_methods = methods

    def enum_name(self, enum: str, number: int) -> str:
        desc = self.__dict__[enum]
        v = desc.values_by_number.get(number)
        return v.name if v is not None else str(number)


_FDS = load_descriptor_set()
pb = _Namespace(build_messages(_FDS), service_methods(_FDS, "Publisher"))

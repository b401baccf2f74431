"""The message classes built from the embedded descriptor set: the set matches proto/, both
branches of the protobuf compatibility shim build working classes, and messages round-trip
through the wire format the C++ daemon parses."""

import os
import shutil
import subprocess
import sys
import unittest
from unittest import mock

from google.protobuf import message_factory

import harness  # noqa: F401  (puts clients/python on sys.path)
from wpub import _proto
from wpub._proto import pb

TOOLS = os.path.join(os.path.dirname(os.path.abspath(_proto.__file__)), "..", "tools")


class DescriptorSetTest(unittest.TestCase):

    @unittest.skipIf(shutil.which("protoc") is None, "protoc is not installed")
    def test_loaded_set_matches_proto_dir(self):
        """The set the package loaded (the embedded one, or WPUB_DESCRIPTOR_SET) describes the
        tree's proto/. (CTest's python_client_descriptor checks the embedded one.)"""
        proto_dir = os.environ.get("WPUB_PROTO_DIR") or os.path.join(TOOLS, "..", "..", "..",
                                                                     "proto")
        loaded = os.environ.get("WPUB_DESCRIPTOR_SET") or _proto._DEFAULT_PATH
        r = subprocess.run([sys.executable, os.path.join(TOOLS, "gen_descriptor.py"), "--check",
                            "--proto_dir", proto_dir, "--out", loaded],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_publisher_methods(self):
        self.assertEqual(pb.publisher_methods["Publish"],
                         ("PublishRequest", "PublicationReport", True, False))
        self.assertEqual(pb.publisher_methods["GetStatus"][:2],
                         ("GetStatusRequest", "GetStatusResponse"))

    def test_missing_file_is_an_import_error(self):
        with self.assertRaises(ImportError):
            _proto.load_descriptor_set("/nonexistent/wpub_v1.binpb")


class ShimTest(unittest.TestCase):

    def build(self):
        return _proto.build_messages(_proto.load_descriptor_set())

    def check(self, classes):
        req = classes["PublishRequest"]()
        req.batch.megatron_name = "decoder.layers.0.mlp.router.weight"
        t = req.batch.tensors.add(name="model.layers.0.mlp.gate.weight", dtype="bfloat16")
        t.shape.extend([4, 64])
        p = t.parts.add()
        p.shape.extend([4, 64])
        p.shm.name, p.shm.offset, p.shm.length = "/seg", 128, 512
        data = req.SerializeToString()
        back = classes["PublishRequest"].FromString(data)
        self.assertEqual(back.WhichOneof("kind"), "batch")
        self.assertEqual(back.batch.tensors[0].parts[0].WhichOneof("source"), "shm")
        self.assertEqual(back.batch.tensors[0].parts[0].shm.offset, 128)
        # Map fields and enums (report) work too.
        rep = classes["PublicationReport"](status=2, version=7)
        rep.bytes_out_by_format["nvfp4"] = 10
        self.assertEqual(classes["PublicationReport"].FromString(rep.SerializeToString())
                         .bytes_out_by_format["nvfp4"], 10)
        self.assertEqual(classes["PublicationStatus"].values_by_number[2].name,
                         "PUBLICATION_STATUS_ABORTED")

    def test_get_prototype_branch(self):
        """protobuf 3.21/4.21 (Debian 12): no GetMessageClass; MessageFactory.GetPrototype."""
        if not hasattr(message_factory.MessageFactory, "GetPrototype"):
            self.skipTest("this protobuf runtime removed MessageFactory.GetPrototype")
        with mock.patch.object(message_factory, "GetMessageClass", None, create=True):
            self.check(self.build())

    def test_get_message_class_branch(self):
        """protobuf >= 4.22 (5.x-7.x on GPU hosts): message_factory.GetMessageClass."""
        if getattr(message_factory, "GetMessageClass", None) is None:
            self.skipTest("this protobuf runtime has no message_factory.GetMessageClass "
                          f"(protobuf {__import__('google.protobuf').protobuf.__version__})")
        self.check(self.build())

    def test_default_classes(self):
        self.check(pb.__dict__)

    def test_private_pool(self):
        """The classes live in a private pool: the default pool stays free for an application's
        own generated wpub modules."""
        from google.protobuf import descriptor_pool
        with self.assertRaises(KeyError):
            descriptor_pool.Default().FindMessageTypeByName("wpub.v1.PublishRequest")


if __name__ == "__main__":
    unittest.main()

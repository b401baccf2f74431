"""Regenerates the embedded wire-API descriptor set at build time when protoc and the
repository's proto/ are available (a source tree build); otherwise the checked-in
wpub/wpub_v1.binpb is packaged as is. Metadata lives in pyproject.toml."""

import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithDescriptor(build_py):
    def run(self):
        proto_dir = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
        if shutil.which("protoc") and os.path.isdir(os.path.join(proto_dir, "wpub", "v1")):
            subprocess.run([sys.executable, os.path.join(HERE, "tools", "gen_descriptor.py"),
                            "--proto_dir", proto_dir], check=True)
        super().run()


setup(cmdclass={"build_py": BuildPyWithDescriptor})

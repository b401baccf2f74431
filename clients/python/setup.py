"""Builds the wpub package without writing into the source tree: setuptools' build/ and
*.egg-info directories go to a temporary directory, and the wire-API descriptor set is
regenerated (when protoc and the repository's proto/ are at hand) into the build directory,
never over the checked-in wpub/wpub_v1.binpb. Metadata lives in pyproject.toml."""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# One scratch directory per build process, removed when it ends.
SCRATCH = tempfile.mkdtemp(prefix="wpub-build-")
atexit.register(shutil.rmtree, SCRATCH, True)


class BuildPyWithDescriptor(build_py):
    def run(self):
        super().run()
        proto_dir = os.path.normpath(os.path.join(HERE, "..", "..", "proto"))
        if shutil.which("protoc") and os.path.isdir(os.path.join(proto_dir, "wpub", "v1")):
            out = os.path.join(self.build_lib, "wpub", "wpub_v1.binpb")
            subprocess.run([sys.executable, os.path.join(HERE, "tools", "gen_descriptor.py"),
                            "--proto_dir", proto_dir, "--out", out], check=True,
                           stdout=subprocess.DEVNULL)


setup(cmdclass={"build_py": BuildPyWithDescriptor},
      options={"build": {"build_base": os.path.join(SCRATCH, "build")},
               "egg_info": {"egg_base": SCRATCH}})

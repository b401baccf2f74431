"""Packaging: a wheel built from the tree (python3 -m build --no-isolation, as CI does) and an
install from the source folder into a venv (the Debian 12 way: PEP 668 refuses a bare pip
install) never write into the checkout, and the installed package has its version, py.typed
and descriptor set and imports from outside the tree. Skips without python3-build/venv/pip."""

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python"))


def snapshot(root: str):
    """{relative path: sha256} of every file under `root`."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def source_version() -> str:
    """wpub/_version.py's __version__, read without importing the package (this test runs
    without the tree on sys.path, as a user's process would)."""
    scope = {}
    with open(os.path.join(SRC, "wpub", "_version.py")) as f:
        exec(f.read(), scope)  # our own one-line module
    return scope["__version__"]


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@unittest.skipUnless(have("build") and have("venv") and have("pip") and have("wheel"),
                     "needs python3-build, python3-venv, python3-pip, python3-wheel")
class PackagingTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="wpub-pkg-")
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",
                                                                       "WPUB_DESCRIPTOR_SET")}
        self.before = snapshot(SRC)

    def tearDown(self):
        self.tmp.cleanup()

    def run_ok(self, args, cwd=None):
        out = subprocess.run(args, cwd=cwd or self.tmp.name, env=self.env, capture_output=True,
                             text=True, timeout=300)
        self.assertEqual(out.returncode, 0, f"{args}:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def assertTreeUnchanged(self):
        after = snapshot(SRC)
        self.assertEqual(sorted(set(after) - set(self.before)), [], "files created in the tree")
        changed = [p for p in self.before if after.get(p) != self.before[p]]
        self.assertEqual(changed, [], "files changed in the tree")

    def venv(self):
        venv = os.path.join(self.tmp.name, "venv")
        self.run_ok([sys.executable, "-m", "venv", "--system-site-packages", venv])
        return os.path.join(venv, "bin", "python")

    def check_installed(self, py):
        code = ("import os, wpub; d = os.path.dirname(wpub.__file__); "
                "print(wpub.__version__, d, os.path.isfile(os.path.join(d, 'py.typed')), "
                "os.path.isfile(os.path.join(d, 'wpub_v1.binpb')), wpub.Publisher.__name__)")
        version, where, typed, binpb, name = self.run_ok([py, "-c", code]).split()
        self.assertEqual(version, source_version())
        self.assertTrue(where.startswith(self.tmp.name), where)
        self.assertEqual((typed, binpb, name), ("True", "True", "Publisher"))

    def test_wheel_from_the_tree(self):
        dist = os.path.join(self.tmp.name, "dist")
        self.run_ok([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                     "--outdir", dist, SRC])
        self.assertTreeUnchanged()
        wheels = os.listdir(dist)
        self.assertEqual(wheels, [f"wpub-{source_version()}-py3-none-any.whl"])
        py = self.venv()
        self.run_ok([py, "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir",
                     os.path.join(dist, wheels[0])])
        self.check_installed(py)

    def test_pip_install_from_the_source_folder(self):
        py = self.venv()
        self.run_ok([py, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                     "--no-index", "--no-cache-dir", SRC])
        self.assertTreeUnchanged()
        self.check_installed(py)


if __name__ == "__main__":
    unittest.main()

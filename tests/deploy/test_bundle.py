"""deploy/bundle.sh: the relocatable tarball is built from the build tree, unpacked into a
clean directory, resolves its shared libraries from its own lib/ (only glibc and the NVIDIA
driver from the host), and runs `wpubd --help` and `wpubctl demo` from there with a minimal
environment."""

import os
import shutil
import subprocess
import tarfile
import tempfile
import unittest

from deploy_util import DEPLOY, binary

SYSTEM = ("linux-vdso.so", "ld-linux", "libc.so", "libm.so", "libdl.so", "libpthread.so",
          "librt.so", "libresolv.so", "libutil.so", "libanl.so", "libnsl.so", "libmvec.so",
          "libcuda.so", "libnvidia-")


class BundleTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        wpubd = binary("WPUBD")
        binary("WPUBCTL")
        binary("WPUB_RECV")
        cls.build_dir = os.environ.get("WPUB_BUILD_DIR") or os.path.dirname(
            os.path.dirname(os.path.dirname(wpubd)))
        cls.dir = tempfile.mkdtemp(prefix="wpub-bundle-")
        cls.tarball = os.path.join(cls.dir, "wpub.tar.gz")
        r = subprocess.run(["bash", os.path.join(DEPLOY, "bundle.sh"), cls.build_dir,
                            cls.tarball], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            shutil.rmtree(cls.dir, ignore_errors=True)
            raise AssertionError(f"bundle.sh failed: {r.stdout}{r.stderr}")
        # Unpack somewhere unrelated to the build tree, under a different name.
        cls.root = os.path.join(cls.dir, "elsewhere", "opt")
        os.makedirs(cls.root)
        with tarfile.open(cls.tarball) as t:
            names = t.getnames()
            top = {n.split("/")[0] for n in names}
            assert len(top) == 1, top
            t.extractall(cls.root)
        cls.root = os.path.join(cls.root, top.pop())
        cls.names = names

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def run_clean(self, *args, timeout=120):
        """Runs a bundle command with an empty environment (no LD_LIBRARY_PATH, no build
        tree on PATH) from a scratch working directory."""
        work = tempfile.mkdtemp(dir=self.dir)
        return subprocess.run(list(args), cwd=work, capture_output=True, text=True,
                              timeout=timeout, env={"PATH": "/usr/bin:/bin", "HOME": work})

    def test_layout(self):
        for b in ("wpubd", "wpubctl", "wpub-recv"):
            self.assertTrue(os.access(os.path.join(self.root, "bin", b), os.X_OK), b)
            self.assertTrue(os.access(os.path.join(self.root, "libexec", b), os.X_OK), b)
        libs = os.listdir(os.path.join(self.root, "lib"))
        self.assertTrue(any(n.startswith("libgrpc++") for n in libs), libs)
        self.assertTrue(any(n.startswith("libprotobuf") for n in libs), libs)
        for n in libs:
            self.assertFalse(n.startswith(SYSTEM), f"{n} should come from the host")
        self.assertTrue(os.path.exists(os.path.join(self.root, "share", "wpub", "grafana",
                                                    "wpub-dashboard.json")))
        # Every library resolves inside the bundle or to glibc / the driver.
        env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": os.path.join(self.root, "lib")}
        for b in ("wpubd", "wpubctl", "wpub-recv"):
            out = subprocess.run(["ldd", os.path.join(self.root, "libexec", b)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                line = line.strip()
                self.assertNotIn("not found", line)
                if "=>" in line and "/" in line.split("=>")[1]:
                    name, path = line.split("=>")[0].strip(), line.split("=>")[1].split()[0]
                    if not name.startswith(SYSTEM):
                        self.assertTrue(path.startswith(self.root), f"{b}: {line}")

    def test_wpubd_help(self):
        r = self.run_clean(os.path.join(self.root, "bin", "wpubd"), "--help")
        out = r.stdout + r.stderr
        self.assertIn("wpubd: publishes model weights", out)
        self.assertIn("--listen", out)
        self.assertNotIn("error while loading shared libraries", out)
        r = self.run_clean(os.path.join(self.root, "bin", "wpubd"), "--helpfull")
        self.assertIn("--tls_cert_file", r.stdout + r.stderr)

    def test_wpubctl_demo(self):
        r = self.run_clean(os.path.join(self.root, "bin", "wpubctl"), "demo", timeout=300)
        out = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, out)
        # Without the wrapper's --wpubd_path/--recv_path the demo would look for a build tree
        # next to libexec/, which the bundle does not have: it ran the bundle's binaries.
        self.assertFalse(os.path.exists(os.path.join(self.root, "wpubd")))
        self.assertIn("committed", out.lower())
        self.assertIn("wpubd stopped (exit 0)", out)


if __name__ == "__main__":
    unittest.main()

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

    def test_python_client_wheel(self):
        import importlib.util
        if not all(importlib.util.find_spec(m) for m in ("build", "wheel", "setuptools")):
            self.skipTest("python3-build, python3-wheel or python3-setuptools missing")
        wheels = [n for n in self.names if n.endswith(".whl")]
        self.assertEqual(len(wheels), 1, self.names)
        self.assertRegex(wheels[0], r"/python/wpub-[0-9.]+-py3-none-any\.whl$")
        import zipfile
        with zipfile.ZipFile(os.path.join(os.path.dirname(self.root), wheels[0])) as z:
            files = z.namelist()
        for f in ("wpub/__init__.py", "wpub/publisher.py", "wpub/wpub_v1.binpb"):
            self.assertIn(f, files)

    def test_wpubctl_demo(self):
        r = self.run_clean(os.path.join(self.root, "bin", "wpubctl"), "demo", timeout=300)
        out = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, out)
        # Without the wrapper's --wpubd_path/--recv_path the demo would look for a build tree
        # next to libexec/, which the bundle does not have: it ran the bundle's binaries.
        self.assertFalse(os.path.exists(os.path.join(self.root, "wpubd")))
        self.assertIn("committed", out.lower())
        self.assertIn("wpubd stopped (exit 0)", out)


class InstallTest(unittest.TestCase):
    """`cmake --install` of the build tree into a fresh prefix: the three binaries in bin/ run,
    `wpubctl demo` finds wpubd and wpub-recv beside it, share/wpub holds the deployment files."""

    def test_install_into_a_prefix(self):
        wpubd = binary("WPUBD")
        build_dir = os.environ.get("WPUB_BUILD_DIR") or os.path.dirname(
            os.path.dirname(os.path.dirname(wpubd)))
        cmake = shutil.which("cmake")
        if cmake is None:
            self.skipTest("cmake is not on PATH")
        prefix = tempfile.mkdtemp(prefix="wpub-install-")
        try:
            r = subprocess.run([cmake, "--install", build_dir, "--prefix", prefix],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            for b in ("wpubd", "wpubctl", "wpub-recv"):
                path = os.path.join(prefix, "bin", b)
                self.assertTrue(os.access(path, os.X_OK), b)
                v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
                self.assertEqual(v.returncode, 0, b + ": " + v.stdout + v.stderr)
            for f in ("systemd/wpubd.service", "prometheus/wpub-alerts.rules.yml",
                      "grafana/wpub-dashboard.json"):
                self.assertTrue(os.path.isfile(os.path.join(prefix, "share", "wpub", f)), f)
            demo = os.path.join(prefix, "demo")
            r = subprocess.run([os.path.join(prefix, "bin", "wpubctl"), "demo",
                                "--demo_versions=1", "--demo_receivers=1", f"--demo_dir={demo}"],
                               capture_output=True, text=True, timeout=300, cwd=prefix)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertTrue(os.path.isfile(os.path.join(demo, "recv-0.safetensors")),
                            "the demo's files are kept")
        finally:
            shutil.rmtree(prefix, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()

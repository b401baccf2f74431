"""Every deployment artefact bounds glibc's malloc arenas (MALLOC_ARENA_MAX), which keeps
wpubd's RSS flat over many publications (tests/daemon/soak_test.cc measures it): the systemd
unit, the wpubd container of the Kubernetes base and every overlay, the container image's
runtime stage, and the bundle's wrappers (which keep a value the caller set)."""

import os
import re
import subprocess
import tempfile
import unittest

from deploy_util import DEPLOY
from test_manifests import K8S, _pod_spec, render

EXPECTED = "2"


class AllocatorSettingTest(unittest.TestCase):

    def test_systemd_unit(self):
        with open(os.path.join(DEPLOY, "systemd", "wpubd.service")) as f:
            service = f.read().split("[Service]", 1)[1].split("[Install]", 1)[0]
        self.assertIn(f"Environment=MALLOC_ARENA_MAX={EXPECTED}", service.splitlines())

    def test_kubernetes_sidecar_in_base_and_overlays(self):
        dirs = [os.path.join(K8S, "base")] + [
            os.path.join(K8S, "overlays", n) for n in sorted(os.listdir(os.path.join(K8S, "overlays")))]
        for d in dirs:
            job = [o for o in render(d) if o["kind"] == "Job"][0]
            wpubd = [c for c in _pod_spec(job)["initContainers"] if c["name"] == "wpubd"][0]
            env = {e["name"]: e.get("value") for e in wpubd.get("env", [])}
            self.assertEqual(env.get("MALLOC_ARENA_MAX"), EXPECTED, d)

    def test_container_image_runtime_stage(self):
        with open(os.path.join(DEPLOY, "Dockerfile")) as f:
            text = re.sub(r"\\\n", " ", f.read())
        runtime = text.split(" AS runtime", 1)[1]
        envs = " ".join(line.strip()[4:] for line in runtime.splitlines()
                        if line.strip().upper().startswith("ENV "))
        self.assertIn(f"MALLOC_ARENA_MAX={EXPECTED}", envs.split())

    def test_bundle_wrappers(self):
        # The wrapper text bundle.sh writes, run as a shell script with a stand-in binary.
        with open(os.path.join(DEPLOY, "bundle.sh")) as f:
            script = f.read()
        wrapper = script.split("<<WRAPPER\n", 1)[1].split("\nWRAPPER\n", 1)[0]
        wrapper = (wrapper.replace("\\$", "$").replace("$extra", "")
                   .replace("$b", "probe"))
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "bin"))
            os.makedirs(os.path.join(root, "libexec"))
            with open(os.path.join(root, "bin", "probe"), "w") as f:
                f.write(wrapper)
            with open(os.path.join(root, "libexec", "probe"), "w") as f:
                f.write('#!/bin/sh\necho "arenas=$MALLOC_ARENA_MAX"\n')
            os.chmod(os.path.join(root, "libexec", "probe"), 0o755)
            env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
            out = subprocess.run(["sh", os.path.join(root, "bin", "probe")], env=env,
                                 capture_output=True, text=True, check=True).stdout
            self.assertEqual(out.strip(), f"arenas={EXPECTED}")
            env["MALLOC_ARENA_MAX"] = "1"
            out = subprocess.run(["sh", os.path.join(root, "bin", "probe")], env=env,
                                 capture_output=True, text=True, check=True).stdout
            self.assertEqual(out.strip(), "arenas=1", "a value the caller set is kept")


if __name__ == "__main__":
    unittest.main()

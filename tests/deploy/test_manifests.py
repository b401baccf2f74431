"""Structural checks of what deploy/ ships: the Kustomize base and every overlay rendered
(resources, generators, images, namespace and JSON6902 patches applied here, as kustomize
would) and checked for the kinds, named ports, gRPC probes, shared IPC/shm, non-root security
contexts, resource requests and a grace period longer than wpubd's drain; the flag files
accepted by a real wpubd; the systemd unit through `systemd-analyze verify`; the Dockerfile's
stages."""

import copy
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

from deploy_util import DEPLOY, REPO, Daemon, binary

K8S = os.path.join(DEPLOY, "k8s")


def _duration_seconds(text: str) -> float:
    total = 0.0
    for value, unit in re.findall(r"([0-9.]+)(ms|s|m|h)", text):
        total += float(value) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def _json_pointer_apply(doc, op):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    parent = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    last = parts[-1]
    if isinstance(parent, list):
        idx = len(parent) if last == "-" else int(last)
        if op["op"] == "add":
            parent.insert(idx, op["value"])
        elif op["op"] == "replace":
            parent[idx] = op["value"]
        elif op["op"] == "remove":
            del parent[idx]
        return
    if op["op"] == "replace" and last not in parent:
        raise AssertionError(f"patch replaces missing path {op['path']}")
    if op["op"] in ("add", "replace"):
        parent[last] = op["value"]
    elif op["op"] == "remove":
        del parent[last]
    else:
        raise AssertionError(f"unsupported patch op {op['op']}")


def render(directory: str):
    """The objects `kustomize build directory` produces, for the features deploy/k8s uses."""
    with open(os.path.join(directory, "kustomization.yaml")) as f:
        k = yaml.safe_load(f)
    allowed = {"apiVersion", "kind", "resources", "configMapGenerator", "secretGenerator",
               "generatorOptions", "labels", "namespace", "images", "patches"}
    unknown = set(k) - allowed
    assert not unknown, f"{directory}: kustomization fields not checked by this test: {unknown}"
    objects = []
    for r in k.get("resources", []):
        path = os.path.join(directory, r)
        if os.path.isdir(path):
            objects += render(path)
        else:
            with open(path) as f:
                objects += [d for d in yaml.safe_load_all(f) if d]
    for gen, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for g in k.get(gen, []):
            data = {}
            for fname in g.get("files", []):
                with open(os.path.join(directory, fname)) as f:
                    data[os.path.basename(fname)] = f.read()
            for lit in g.get("literals", []):
                key, value = lit.split("=", 1)
                data[key] = value
            objects.append({"apiVersion": "v1", "kind": kind, "metadata": {"name": g["name"]},
                            "data" if kind == "ConfigMap" else "stringData": data})
    for lab in k.get("labels", []):
        for o in objects:
            o["metadata"].setdefault("labels", {}).update(lab["pairs"])
    if "namespace" in k:
        for o in objects:
            o["metadata"]["namespace"] = k["namespace"]
    for img in k.get("images", []):
        for o in objects:
            for c in _containers(o):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    for p in k.get("patches", []):
        t = p["target"]
        hits = [o for o in objects if o["kind"] == t["kind"] and o["metadata"]["name"] == t["name"]]
        assert hits, f"{directory}: patch target {t} matches nothing"
        for o in hits:
            for op in yaml.safe_load(p["patch"]):
                _json_pointer_apply(o, op)
    return objects


def _pod_spec(o):
    spec = o.get("spec", {})
    if o["kind"] in ("Job", "Deployment", "StatefulSet", "DaemonSet"):
        return spec["template"]["spec"]
    return None


def _containers(o):
    pod = _pod_spec(o)
    return [] if pod is None else pod.get("initContainers", []) + pod.get("containers", [])


class KubernetesTest(unittest.TestCase):

    def layouts(self):
        out = {"base": render(os.path.join(K8S, "base"))}
        for name in sorted(os.listdir(os.path.join(K8S, "overlays"))):
            out[name] = render(os.path.join(K8S, "overlays", name))
        self.assertGreaterEqual(len(out), 2, "at least one overlay")
        return out

    def check_layout(self, name, objects):
        by_kind = {}
        for o in objects:
            self.assertIn("apiVersion", o, name)
            by_kind.setdefault(o["kind"], []).append(o)
        for kind in ("Job", "Service", "PodMonitor", "ConfigMap", "Secret", "NetworkPolicy"):
            self.assertEqual(len(by_kind.get(kind, [])), 1, f"{name}: one {kind}")
        job, svc, mon = by_kind["Job"][0], by_kind["Service"][0], by_kind["PodMonitor"][0]
        cfg, secret = by_kind["ConfigMap"][0], by_kind["Secret"][0]
        pod = _pod_spec(job)
        pod_labels = job["spec"]["template"]["metadata"]["labels"]

        # The sidecar: a native sidecar (restartable init container) named wpubd.
        sidecars = [c for c in pod.get("initContainers", []) if c["name"] == "wpubd"]
        self.assertEqual(len(sidecars), 1, f"{name}: wpubd sidecar")
        wpubd = sidecars[0]
        self.assertEqual(wpubd.get("restartPolicy"), "Always", f"{name}: native sidecar")
        trainers = pod["containers"]
        self.assertEqual([c["name"] for c in trainers], ["trainer"], name)
        trainer = trainers[0]

        # Named ports and gRPC probes on the health service.
        ports = {p["name"]: p["containerPort"] for p in wpubd["ports"]}
        self.assertEqual(set(ports), {"grpc", "metrics"}, name)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertIn(probe, wpubd, f"{name}: {probe}")
            self.assertIn("grpc", wpubd[probe], f"{name}: {probe} is a gRPC probe")
            self.assertEqual(wpubd[probe]["grpc"]["port"], ports["grpc"], f"{name}: {probe}")
        self.assertIn(wpubd["readinessProbe"]["grpc"].get("service", ""),
                      ("", "wpub.v1.Publisher", "wpub.v1.Receivers"),
                      f"{name}: readiness probes a service wpubd reports health for")

        # What CUDA IPC and POSIX shm need: shared process (or host IPC) namespace and one
        # memory-backed /dev/shm mounted in both containers.
        self.assertTrue(pod.get("shareProcessNamespace") or pod.get("hostIPC"), name)
        vols = {v["name"]: v for v in pod["volumes"]}
        for c in (wpubd, trainer):
            shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            self.assertEqual(len(shm), 1, f"{name}: /dev/shm in {c['name']}")
            self.assertEqual(vols[shm[0]["name"]]["emptyDir"]["medium"], "Memory", name)
        self.assertIn("nvidia.com/gpu", trainer["resources"]["requests"], name)

        # Non-root, no privilege escalation, resource requests.
        psc = pod["securityContext"]
        self.assertTrue(psc["runAsNonRoot"], name)
        self.assertNotEqual(psc.get("runAsUser", 0), 0, name)
        for c in (wpubd, trainer):
            self.assertFalse(c["securityContext"]["allowPrivilegeEscalation"], name)
            self.assertNotIn("privileged", c["securityContext"])
            self.assertIn("cpu", c["resources"]["requests"], f"{name}: {c['name']} cpu request")
            self.assertIn("memory", c["resources"]["requests"], f"{name}: {c['name']} memory")

        # wpubd's flags: read from the ConfigMap through --config; the grace period outlasts
        # the drain deadline plus the shutdown grace.
        config_arg = [a for a in wpubd["args"] if a.startswith("--config=")]
        self.assertEqual(len(config_arg), 1, name)
        config_path = config_arg[0].split("=", 1)[1]
        mount = [m for m in wpubd["volumeMounts"]
                 if config_path.startswith(m["mountPath"].rstrip("/") + "/")]
        self.assertEqual(len(mount), 1, f"{name}: {config_path} is mounted")
        self.assertEqual(vols[mount[0]["name"]]["configMap"]["name"], cfg["metadata"]["name"])
        flags_text = cfg["data"][os.path.basename(config_path)]
        flags = dict(line.split("=", 1) for line in flags_text.split() if "=" in line)
        drain = _duration_seconds(flags.get("--drain_deadline", "30s"))
        grace = _duration_seconds(flags.get("--shutdown_grace", "1s"))
        self.assertGreater(pod["terminationGracePeriodSeconds"], drain + grace,
                           f"{name}: terminationGracePeriodSeconds vs --drain_deadline")
        # The token file wpubd reads lies in the mounted Secret.
        token_path = flags["--auth_token_file"]
        tmount = [m for m in wpubd["volumeMounts"]
                  if token_path.startswith(m["mountPath"].rstrip("/") + "/")]
        self.assertEqual(len(tmount), 1, f"{name}: token file mounted")
        self.assertEqual(vols[tmount[0]["name"]]["secret"]["secretName"],
                         secret["metadata"]["name"])
        self.assertIn(os.path.basename(token_path), secret["stringData"])
        # A metrics port reachable by Prometheus (pod IP) on the port the container names.
        self.assertEqual(int(flags["--metrics_listen"].rsplit(":", 1)[1]), ports["metrics"])
        self.assertEqual(int(flags["--listen"].rsplit(":", 1)[1]), ports["grpc"])

        # Service and PodMonitor point at the pod and its named ports.
        self.assertTrue(set(svc["spec"]["selector"].items()) <= set(pod_labels.items()), name)
        self.assertEqual({p["name"] for p in svc["spec"]["ports"]}, {"grpc", "metrics"}, name)
        for p in svc["spec"]["ports"]:
            self.assertEqual(p["targetPort"], p["name"])
        sel = mon["spec"]["selector"]["matchLabels"]
        self.assertTrue(set(sel.items()) <= set(pod_labels.items()), name)
        self.assertEqual([e["port"] for e in mon["spec"]["podMetricsEndpoints"]], ["metrics"])
        netpol = by_kind["NetworkPolicy"][0]
        for rule in netpol["spec"]["ingress"]:
            for p in rule["ports"]:
                self.assertIn(p["port"], ports, f"{name}: NetworkPolicy port")
        return flags_text, job

    def test_base_and_overlays(self):
        layouts = self.layouts()
        jobs = {}
        for name, objects in layouts.items():
            with self.subTest(layout=name):
                flags_text, jobs[name] = self.check_layout(name, objects)
        # Overlays change something (else they are copies) and keep the base's shape.
        for name in layouts:
            if name != "base":
                self.assertNotEqual(jobs[name], jobs["base"], f"overlay {name} changes nothing")
                ns = {o["metadata"].get("namespace") for o in layouts[name]}
                self.assertEqual(len(ns), 1, f"{name}: one namespace for every object")

    def test_same_as_kustomize(self):
        """Where kustomize (or kubectl) is installed, its output is what this test checks."""
        if shutil.which("kustomize"):
            cmd = ["kustomize", "build"]
        elif shutil.which("kubectl"):
            cmd = ["kubectl", "kustomize"]
        else:
            self.skipTest("neither kustomize nor kubectl is installed; render() stands in")
        for name, objects in self.layouts().items():
            path = os.path.join(K8S, "base") if name == "base" else os.path.join(
                K8S, "overlays", name)
            out = subprocess.run(cmd + [path], capture_output=True, text=True, check=True).stdout
            real = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}
            mine = {(o["kind"], o["metadata"]["name"]): o for o in objects}
            self.assertEqual(set(real), set(mine), name)
            for key in ("Job", "wpub-trainer"), ("Service", "wpubd"):
                self.assertEqual(real[key]["spec"], mine[key]["spec"], f"{name}: {key}")

    def test_sidecar_flags_start_a_real_wpubd(self):
        """The ConfigMap's flag file is accepted by wpubd (names and values); only the
        addresses are moved to free loopback ports and the token to a temp file."""
        objects = render(os.path.join(K8S, "base"))
        cfg = [o for o in objects if o["kind"] == "ConfigMap"][0]
        d = tempfile.mkdtemp(prefix="wpub-k8s-")
        try:
            # The file is expanded where --config stands, after Daemon's own address flags:
            # rewrite its addresses to free loopback ports (the pod's fixed ports would
            # collide with other tests).
            text = cfg["data"]["wpubd.flags"]
            for flag in ("--listen", "--metrics_listen"):
                text, n = re.subn(rf"^{flag}=\S+$", f"{flag}=127.0.0.1:0", text, flags=re.M)
                self.assertEqual(n, 1, flag)
            flagfile = os.path.join(d, "wpubd.flags")
            with open(flagfile, "w") as f:
                f.write(text)
            token = os.path.join(d, "token")
            with open(token, "w") as f:
                f.write("t0ken\n")
            daemon = Daemon(d, f"--config={flagfile}", f"--auth_token_file={token}",
                            metrics="127.0.0.1:0")
            self.assertGreater(daemon.port, 0)
            self.assertEqual(daemon.stop(), 0, daemon.log())
        finally:
            shutil.rmtree(d, ignore_errors=True)


class SystemdTest(unittest.TestCase):

    def test_unit_verifies(self):
        tool = shutil.which("systemd-analyze")
        if tool is None:
            self.skipTest("systemd-analyze is not installed (Debian package systemd)")
        wpubd = binary("WPUBD")
        d = tempfile.mkdtemp(prefix="wpub-systemd-")
        try:
            with open(os.path.join(DEPLOY, "systemd", "wpubd.service")) as f:
                unit = f.read()
            self.assertIn("ExecStart=/opt/wpub/bin/wpubd ", unit)
            for key in ("Restart=on-failure", "EnvironmentFile=", "DeviceAllow=/dev/nvidiactl",
                        "NoNewPrivileges=yes", "LoadCredential=token:"):
                self.assertIn(key, unit)
            # Options that would break GPU access or CUDA IPC must stay off.
            directives = [l for l in unit.splitlines() if not l.lstrip().startswith("#")]
            for bad in ("PrivateDevices=yes", "PrivateIPC=yes", "MemoryDenyWriteExecute=yes",
                        "ProtectProc=invisible"):
                self.assertNotIn(bad, directives)
            # TimeoutStopSec outlasts the default drain deadline and the env file's.
            stop = _duration_seconds(re.search(r"^TimeoutStopSec=(\S+)", unit, re.M).group(1))
            with open(os.path.join(DEPLOY, "systemd", "wpubd.env")) as f:
                env = f.read()
            args = re.search(r'^WPUBD_ARGS="([^"]*)"', env, re.M).group(1).split()
            drain = _duration_seconds(dict(a.split("=", 1) for a in args).get(
                "--drain_deadline", "30s"))
            self.assertGreater(stop, drain)
            path = os.path.join(d, "wpubd.service")
            with open(path, "w") as f:
                f.write(unit.replace("/opt/wpub/bin/wpubd", wpubd))
            r = subprocess.run([tool, "verify", path], capture_output=True, text=True,
                               timeout=120)
            out = r.stdout + r.stderr
            # Verification in a container without systemd as PID 1 still parses every
            # directive; an unknown key or an invalid value is reported against its line
            # ("wpubd.service:46: Unknown key ...") while the exit code stays 0.
            self.assertNotRegex(out, re.escape(path) + r":\d+:", out)
            self.assertNotIn("Unknown key", out, out)
            self.assertNotIn("Unknown section", out, out)
            self.assertNotIn("is not executable", out, out)
            self.assertNotIn("Failed to parse", out, out)
            self.assertEqual(r.returncode, 0, out)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def test_env_file_flags_start_a_real_wpubd(self):
        with open(os.path.join(DEPLOY, "systemd", "wpubd.env")) as f:
            env = f.read()
        args = re.search(r'^WPUBD_ARGS="([^"]*)"', env, re.M).group(1).split()
        args = [a for a in args if not a.startswith(("--listen=", "--metrics_listen="))]
        d = tempfile.mkdtemp(prefix="wpub-env-")
        try:
            daemon = Daemon(d, *args, metrics="127.0.0.1:0")
            self.assertEqual(daemon.stop(), 0, daemon.log())
        finally:
            shutil.rmtree(d, ignore_errors=True)


class DockerfileTest(unittest.TestCase):

    def instructions(self):
        with open(os.path.join(DEPLOY, "Dockerfile")) as f:
            text = re.sub(r"\\\n", " ", f.read())
        out = []
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                word, _, rest = line.partition(" ")
                out.append((word.upper(), rest.strip()))
        return out

    def test_stages(self):
        ins = self.instructions()
        known = {"ARG", "FROM", "ENV", "COPY", "RUN", "WORKDIR", "USER", "EXPOSE", "STOPSIGNAL",
                 "ENTRYPOINT", "CMD", "LABEL", "HEALTHCHECK"}
        for word, _ in ins:
            self.assertIn(word, known)
        froms = [rest for word, rest in ins if word == "FROM"]
        self.assertEqual(len(froms), 2, froms)
        self.assertRegex(froms[0], r"^nvidia/cuda:\S*-devel-\S* AS build$")
        self.assertRegex(froms[1], r"^nvidia/cuda:\S*-runtime-\S* AS runtime$")
        runtime = ins[[i for i, (w, _) in enumerate(ins) if w == "FROM"][1]:]
        build = ins[:[i for i, (w, _) in enumerate(ins) if w == "FROM"][1]]
        # Build: the development machine's packages and the bundle script, both in the repo.
        build_runs = " ".join(r for w, r in build if w == "RUN")
        self.assertIn("install_deps.sh", build_runs)
        self.assertIn("deploy/bundle.sh", build_runs)
        for w, r in build:
            if w == "COPY" and not r.startswith("--from"):
                src = r.split()[0]
                self.assertTrue(os.path.exists(os.path.join(REPO, src)), src)
        # Runtime: only the bundle from the build stage, a non-root numeric user matching the
        # Kubernetes securityContext, the ports the manifests name.
        copies = [r for w, r in runtime if w == "COPY"]
        self.assertTrue(copies and all(c.startswith("--from=build ") for c in copies), copies)
        self.assertFalse([r for w, r in runtime if w == "RUN" and "apt-get" in r])
        user = [r for w, r in runtime if w == "USER"][-1]
        uid = int(user.split(":")[0])
        self.assertNotEqual(uid, 0)
        job = [o for o in render(os.path.join(K8S, "base")) if o["kind"] == "Job"][0]
        self.assertEqual(job["spec"]["template"]["spec"]["securityContext"]["runAsUser"], uid)
        exposed = {int(p) for w, r in runtime if w == "EXPOSE" for p in r.split()}
        self.assertEqual(exposed, {50151, 9464})
        entry = [r for w, r in runtime if w == "ENTRYPOINT"][-1]
        self.assertEqual(yaml.safe_load(entry), ["/opt/wpub/bin/wpubd"])
        with open(os.path.join(DEPLOY, "bundle.sh")) as f:
            self.assertIn('"$root/bin/$b"', f.read(), "the bundle provides bin/wpubd")


if __name__ == "__main__":
    unittest.main()

"""Structural checks of what deploy/ ships: the Kustomize base, every overlay and the example
engines rendered (resources, generators, images, namespace and JSON6902 patches applied here, as
kustomize would; compared with kustomize's own output where it is installed) and checked for the
kinds, named ports, gRPC probes, shared IPC/shm, non-root security contexts, resource requests
and a grace period longer than wpubd's drain, and for what connects the pieces: the trainer's
WPUB_TARGET / WPUB_TOKEN_FILE against wpubd's flags, the TCPStore ports, the Service, the
NetworkPolicies between wpubd and the engines (NCCL's ephemeral range), the Unix-socket layout;
every object validated against a JSON Schema subset of the Kubernetes API (tests/deploy/schemas)
that refuses unknown fields, and broken objects refused; each layout's flags and environment
run against a real wpubd and the Python client; the systemd unit through `systemd-analyze
verify` and wpubd's READY=1 notification; the Dockerfile's stages."""

import copy
import json
import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import unittest

import grpc
import yaml

from deploy_util import DEPLOY, REPO, Daemon, binary, free_port
import wpub  # noqa: E402 (deploy_util puts clients/python on sys.path)
from wpub import publisher  # noqa: E402

K8S = os.path.join(DEPLOY, "k8s")
EXAMPLES = os.path.join(K8S, "examples")
SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas",
                      "kubernetes.schema.json")
# The kernel's default net.ipv4.ip_local_port_range: where NCCL's listeners bind.
EPHEMERAL = (32768, 60999)


class _Daemon(Daemon):
    """Daemon that closes its log file when wpubd exits before it is ready."""

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            if getattr(self, "_log", None) is not None:
                self._log.close()
            raise


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


def _by_kind(objects):
    out = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def _flag_pairs(text: str):
    """(name, value) of each `--name=value` line of an absl flag file."""
    return [tuple(line.split("=", 1)) for line in text.split() if "=" in line]


def _expand(value: str, env: dict) -> str:
    """The kubelet's $(VAR) expansion of command and args, from the container's env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env[m.group(1)] if m.group(1) in env else m.group(0), value)


def effective_flags(wpubd, cfg):
    """wpubd's flags as it sees them: the ConfigMap's file where --config stands, then the
    container's later args (absl: a later flag overrides). Returns (flags, config path, the
    args after --config)."""
    args = wpubd["args"]
    config = [i for i, a in enumerate(args) if a.startswith("--config=")]
    assert len(config) == 1, args
    path = args[config[0]].split("=", 1)[1]
    flags = dict(_flag_pairs(cfg["data"][os.path.basename(path)]))
    overrides = args[config[0] + 1:]
    for a in overrides:
        assert a.startswith("--") and "=" in a, f"wpubd arg {a!r} is not --name=value"
        name, value = a.split("=", 1)
        flags[name] = value
    return flags, path, overrides


def selector_matches(selector, labels) -> bool:
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        op = e["operator"]
        if ((op == "In" and value not in e["values"]) or
                (op == "NotIn" and present and value in e["values"]) or
                (op == "Exists" and not present) or (op == "DoesNotExist" and present)):
            return False
    return True


def admitted(policy, peer_labels):
    """What a NetworkPolicy admits between its pods and pods labelled `peer_labels` in its own
    namespace (ingress: from them; egress: to them): a list of port entries, or None for every
    port."""
    spec = policy["spec"]
    out = []
    for direction, key in (("ingress", "from"), ("egress", "to")):
        for rule in spec.get(direction, []):
            peers = rule.get(key)
            if peers is not None and not any(
                    set(p) == {"podSelector"} and selector_matches(p["podSelector"], peer_labels)
                    for p in peers):
                continue
            if "ports" not in rule:
                return None
            out += rule["ports"]
    return out


def covers(entries, port=None, lo=None, hi=None, number=None) -> bool:
    """Whether admitted port entries (from admitted()) cover the named `port` (whose number is
    `number`) or the TCP range lo..hi."""
    if entries is None:
        return True
    for e in entries:
        if e.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in e:
            return True
        p = e["port"]
        if port is not None and (p == port or (number is not None and p == number)):
            return True
        if lo is not None and isinstance(p, int) and p <= lo and e.get("endPort", p) >= hi:
            return True
    return False


def engine_pods():
    """Pod-template labels of the example rollout engines (deploy/k8s/examples)."""
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in render(EXAMPLES) if d["kind"] == "Deployment"}


class KubernetesTest(unittest.TestCase):

    def layouts(self):
        out = {"base": render(os.path.join(K8S, "base"))}
        for name in sorted(os.listdir(os.path.join(K8S, "overlays"))):
            out[name] = render(os.path.join(K8S, "overlays", name))
        self.assertGreaterEqual(len(out), 3, "the base and at least two overlays")
        self.assertIn("unix-socket", out)
        return out

    def check_layout(self, name, objects):
        by_kind = _by_kind(objects)
        for o in objects:
            self.assertIn("apiVersion", o, name)
        for kind in ("Job", "Service", "PodMonitor", "ConfigMap", "NetworkPolicy",
                     "PrometheusRule"):
            self.assertEqual(len(by_kind.get(kind, [])), 1, f"{name}: one {kind}")
        # No secret is shipped: the token's Secret is created by the operator (base README).
        self.assertNotIn("Secret", by_kind, f"{name}: a Secret with a token in the manifests")
        self.assertNotIn("Deployment", by_kind, f"{name}: the example engines are not in it")
        job, svc, mon = by_kind["Job"][0], by_kind["Service"][0], by_kind["PodMonitor"][0]
        cfg = by_kind["ConfigMap"][0]
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
        vols = {v["name"]: v for v in pod["volumes"]}

        # wpubd's flags: the ConfigMap's file through --config, then the later args.
        flags, config_path, _ = effective_flags(wpubd, cfg)
        mount = [m for m in wpubd["volumeMounts"]
                 if config_path.startswith(m["mountPath"].rstrip("/") + "/")]
        self.assertEqual(len(mount), 1, f"{name}: {config_path} is mounted")
        self.assertEqual(vols[mount[0]["name"]]["configMap"]["name"], cfg["metadata"]["name"])
        listen = flags["--listen"]
        unix = listen.startswith("unix:")

        # Named ports: gRPC (unless it listens on a Unix socket), metrics, the TCPStore ports.
        ports = {p["name"]: p["containerPort"] for p in wpubd["ports"]}
        want_ports = {"metrics", "nccl-store", "nccl-store-vllm"} | (set() if unix else {"grpc"})
        self.assertEqual(set(ports), want_ports, name)
        self.assertEqual(int(flags["--metrics_listen"].rsplit(":", 1)[1]), ports["metrics"])
        probes = ("startupProbe", "readinessProbe", "livenessProbe")
        for probe in probes:
            self.assertIn(probe, wpubd, f"{name}: {probe}")
        if not unix:
            self.assertEqual(int(listen.rsplit(":", 1)[1]), ports["grpc"], name)
            for probe in probes:
                self.assertIn("grpc", wpubd[probe], f"{name}: {probe} is a gRPC probe")
                self.assertEqual(wpubd[probe]["grpc"]["port"], ports["grpc"], f"{name}: {probe}")
            self.assertIn(wpubd["readinessProbe"]["grpc"].get("service", ""),
                          ("", "wpub.v1.Publisher", "wpub.v1.Receivers"),
                          f"{name}: readiness probes a service wpubd reports health for")

        # What CUDA IPC and POSIX shm need: shared process (or host IPC) namespace and one
        # memory-backed /dev/shm mounted in both containers.
        self.assertTrue(pod.get("shareProcessNamespace") or pod.get("hostIPC"), name)
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

        # The grace period outlasts the drain deadline plus the shutdown grace.
        drain = _duration_seconds(flags.get("--drain_deadline", "30s"))
        grace = _duration_seconds(flags.get("--shutdown_grace", "1s"))
        self.assertGreater(pod["terminationGracePeriodSeconds"], drain + grace,
                           f"{name}: terminationGracePeriodSeconds vs --drain_deadline")

        # The token: wpubd's --auth_token_file and the trainer's WPUB_TOKEN_FILE are the same
        # file (key `token`) of the same Secret, `wpubd-token`, which the operator creates
        # (deploy/k8s/base/kustomization.yaml, deploy/README.md say how), mounted in both.
        token_path = flags["--auth_token_file"]
        self.assertEqual(os.path.basename(token_path), "token", name)
        for c in (wpubd, trainer):
            tmount = [m for m in c["volumeMounts"]
                      if token_path.startswith(m["mountPath"].rstrip("/") + "/")]
            self.assertEqual(len(tmount), 1, f"{name}: token file mounted in {c['name']}")
            self.assertEqual(vols[tmount[0]["name"]]["secret"]["secretName"], "wpubd-token",
                             f"{name}: {c['name']}")

        # The trainer's environment: only variables wpub.Publisher.from_env() reads, a target
        # that is wpubd's listener, the token file wpubd reads.
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        wpub_vars = {k for k in env if k.startswith("WPUB_")}
        self.assertLessEqual(wpub_vars, set(publisher.ENV_VARS), f"{name}: unknown WPUB_ vars")
        self.assertEqual(env.get("WPUB_TOKEN_FILE"), token_path,
                         f"{name}: WPUB_TOKEN_FILE is wpubd's --auth_token_file")
        target = env["WPUB_TARGET"]
        if unix:
            socket_path = listen[len("unix:"):]
            self.assertEqual(target, "unix://" + socket_path, name)
            # The socket's directory: one emptyDir mounted in both containers.
            sdir = os.path.dirname(socket_path)
            run_vols = set()
            for c in (wpubd, trainer):
                m = [m for m in c["volumeMounts"] if m["mountPath"].rstrip("/") == sdir]
                self.assertEqual(len(m), 1, f"{name}: {sdir} mounted in {c['name']}")
                self.assertFalse(m[0].get("readOnly", False), f"{name}: {c['name']}")
                run_vols.add(m[0]["name"])
            self.assertEqual(len(run_vols), 1, f"{name}: the same volume at {sdir}")
            self.assertIn("emptyDir", vols[run_vols.pop()], name)
            # Kubernetes' gRPC probes need a TCP port: these run wpubctl on the socket.
            for probe in probes:
                cmd = wpubd[probe]["exec"]["command"]
                self.assertEqual(cmd[:2], ["/opt/wpub/bin/wpubctl", "status"], f"{name}: {probe}")
                self.assertIn(f"--target={listen}", cmd, f"{name}: {probe}")
                self.assertIn(f"--auth_token_file={token_path}", cmd, f"{name}: {probe}")
        else:
            host, port = target.rsplit(":", 1)
            self.assertIn(host, ("127.0.0.1", "localhost"), f"{name}: the pod's loopback")
            self.assertEqual(int(port), ports["grpc"], f"{name}: WPUB_TARGET is wpubd's port")

        # GPU path: the TCPStore on a fixed port the container names, vLLM's on the next one,
        # reachable from other pods (non-loopback bind, acknowledged), advertised as the pod IP.
        self.assertEqual(flags.get("--gpu_path"), "true", name)
        # A publication that would reach no engine or receiver aborts instead of committing.
        self.assertGreaterEqual(int(flags.get("--min_receivers", "0")), 1,
                                f"{name}: --min_receivers")
        store_host, store_port = flags["--nccl_store_listen"].rsplit(":", 1)
        self.assertEqual(store_host, "0.0.0.0", name)
        self.assertEqual(int(store_port), ports["nccl-store"],
                         f"{name}: --nccl_store_listen's port is nccl-store")
        self.assertEqual(ports["nccl-store-vllm"], ports["nccl-store"] + 1,
                         f"{name}: nccl-store-vllm is nccl-store + 1")
        self.assertNotEqual(ports["nccl-store"], 29500, "29500 is the trainer's MASTER_PORT")
        self.assertNotIn(29500, ports.values())
        self.assertEqual(flags["--insecure_listen"], "true", name)
        wenv = {e["name"]: e for e in wpubd["env"]}
        self.assertEqual(flags.get("--nccl_advertise_address"), "$(POD_IP)",
                         f"{name}: wpubd advertises the pod IP")
        self.assertEqual(wenv["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP")

        # Service and PodMonitor point at the pod and its named ports.
        self.assertTrue(set(svc["spec"]["selector"].items()) <= set(pod_labels.items()), name)
        self.assertEqual({p["name"] for p in svc["spec"]["ports"]}, set(ports), name)
        for p in svc["spec"]["ports"]:
            self.assertEqual(p["targetPort"], p["name"])
            self.assertEqual(p["port"], ports[p["name"]], f"{name}: Service port {p['name']}")
        self.assertEqual(pod.get("subdomain"), svc["metadata"]["name"],
                         f"{name}: per-pod DNS names under the headless Service")
        self.assertEqual(svc["spec"].get("clusterIP"), "None", name)
        sel = mon["spec"]["selector"]["matchLabels"]
        self.assertTrue(set(sel.items()) <= set(pod_labels.items()), name)
        self.assertEqual([e["port"] for e in mon["spec"]["podMetricsEndpoints"]], ["metrics"])

        # NetworkPolicy: the training pods, named ports that exist, and every connection the
        # layout needs admitted.
        netpol = by_kind["NetworkPolicy"][0]
        self.assertTrue(selector_matches(netpol["spec"]["podSelector"], pod_labels), name)
        self.assertEqual(netpol["spec"]["policyTypes"], ["Ingress"], name)
        for rule in netpol["spec"]["ingress"]:
            for p in rule.get("ports", []):
                if isinstance(p["port"], str):
                    self.assertIn(p["port"], ports, f"{name}: NetworkPolicy port")
                    self.assertNotIn("endPort", p)
                else:
                    self.assertGreaterEqual(p.get("endPort", p["port"]), p["port"], name)
        monitoring = [r for r in netpol["spec"]["ingress"]
                      if any(f.get("namespaceSelector", {}).get("matchLabels", {}).get(
                          "kubernetes.io/metadata.name") == "monitoring"
                          for f in r.get("from", []))]
        self.assertTrue(monitoring and all(covers(r["ports"], "metrics") for r in monitoring),
                        f"{name}: the monitoring namespace reaches metrics (and only that)")
        if not unix:
            self.assertTrue(covers(admitted(netpol, {"app.kubernetes.io/part-of": "wpub"}),
                                   "grpc", number=ports["grpc"]), f"{name}: wpub pods -> grpc")
        self.assertIsNone(admitted(netpol, pod_labels),
                          f"{name}: the training pods reach each other on every port")
        self.assertFalse(covers(admitted(netpol, {"app": "other"}), "metrics"),
                         f"{name}: an unrelated pod is not admitted")
        for engine, labels in engine_pods().items():
            got = admitted(netpol, labels)
            for store in ("nccl-store", "nccl-store-vllm"):
                self.assertTrue(covers(got, store, number=ports[store]),
                                f"{name}: engine {engine} -> {store}")
            self.assertTrue(covers(got, lo=EPHEMERAL[0], hi=EPHEMERAL[1]),
                            f"{name}: engine {engine} -> NCCL's ephemeral ports")
        return flags, job

    def test_base_and_overlays(self):
        layouts = self.layouts()
        jobs = {}
        for name, objects in layouts.items():
            with self.subTest(layout=name):
                _, jobs[name] = self.check_layout(name, objects)
        # Overlays change something (else they are copies) and keep the base's shape.
        for name in layouts:
            if name != "base" and name in jobs and "base" in jobs:  # (else a subtest failed)
                self.assertNotEqual(jobs[name], jobs["base"], f"overlay {name} changes nothing")
                ns = {o["metadata"].get("namespace") for o in layouts[name]}
                self.assertEqual(len(ns), 1, f"{name}: one namespace for every object")

    def test_check_layout_fails_on_broken_connections(self):
        """check_layout fails when what connects the pieces is broken."""
        def job_of(objs):
            return [o for o in objs if o["kind"] == "Job"][0]

        def wpubd_of(objs):
            return _pod_spec(job_of(objs))["initContainers"][0]

        def trainer_env(objs, var):
            return [e for e in _pod_spec(job_of(objs))["containers"][0]["env"]
                    if e["name"] == var][0]

        def netpol_of(objs):
            return [o for o in objs if o["kind"] == "NetworkPolicy"][0]

        def set_target(objs):
            trainer_env(objs, "WPUB_TARGET")["value"] = "127.0.0.1:50152"

        def set_token(objs):
            trainer_env(objs, "WPUB_TOKEN_FILE")["value"] = "/var/run/secrets/wpub/other"

        def unknown_var(objs):
            _pod_spec(job_of(objs))["containers"][0]["env"].append(
                {"name": "WPUB_ADDRESS", "value": "127.0.0.1:50151"})

        def store_port(objs):
            wpubd_of(objs)["args"].append("--nccl_store_listen=0.0.0.0:29600")

        def vllm_port(objs):
            [p for p in wpubd_of(objs)["ports"] if p["name"] == "nccl-store-vllm"][0][
                "containerPort"] = 29520

        def no_engines(objs):
            netpol_of(objs)["spec"]["ingress"] = [
                r for r in netpol_of(objs)["spec"]["ingress"]
                if not any("app.kubernetes.io/component" in f.get("podSelector", {}).get(
                    "matchLabels", {}) for f in r.get("from", []))]

        def no_subdomain(objs):
            del _pod_spec(job_of(objs))["subdomain"]

        def no_advertise(objs):
            wpubd_of(objs)["args"] = [a for a in wpubd_of(objs)["args"]
                                      if not a.startswith("--nccl_advertise_address")]

        cases = {"WPUB_TARGET is wpubd's port": set_target,
                 "WPUB_TOKEN_FILE is wpubd's": set_token,
                 "unknown WPUB_ vars": unknown_var,
                 "--nccl_store_listen's port is nccl-store": store_port,
                 "nccl-store-vllm is nccl-store": vllm_port,
                 "engine sglang-engine-0 -> nccl-store": no_engines,
                 "per-pod DNS": no_subdomain,
                 "wpubd advertises the pod IP": no_advertise}
        base = render(os.path.join(K8S, "base"))
        self.check_layout("base", copy.deepcopy(base))
        for what, mutate in cases.items():
            with self.subTest(broken=what):
                objs = copy.deepcopy(base)
                mutate(objs)
                with self.assertRaisesRegex(AssertionError, re.escape(what)):
                    self.check_layout("base", objs)

    def test_engine_examples(self):
        """deploy/k8s/examples: an SGLang and a vLLM engine that wpubd can reach and that can
        reach wpubd's TCPStore, with the flags their families need."""
        objects = render(EXAMPLES)
        by_kind = _by_kind(objects)
        self.assertEqual(sorted(by_kind), ["Deployment", "NetworkPolicy", "Service"])
        base = render(os.path.join(K8S, "base"))
        job = [o for o in base if o["kind"] == "Job"][0]
        trainer_labels = job["spec"]["template"]["metadata"]["labels"]
        engine_policy = by_kind["NetworkPolicy"][0]
        with open(os.path.join(EXAMPLES, "networkpolicy-egress.yaml")) as f:
            egress = {o["metadata"]["name"]: o for o in yaml.safe_load_all(f) if o}
        families = {}
        for dep in by_kind["Deployment"]:
            name = dep["metadata"]["name"]
            labels = dep["spec"]["template"]["metadata"]["labels"]
            self.assertEqual(labels.get("app.kubernetes.io/component"), "rollout-engine", name)
            self.assertEqual(dep["spec"]["replicas"], 1, f"{name}: one engine per Deployment")
            self.assertTrue(selector_matches(dep["spec"]["selector"], labels), name)
            (c,) = _pod_spec(dep)["containers"]
            http = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
            self.assertEqual(c["readinessProbe"]["httpGet"], {"path": "/health", "port": "http"})
            svcs = [s for s in by_kind["Service"] if selector_matches(
                {"matchLabels": s["spec"]["selector"]}, labels)]
            self.assertEqual(len(svcs), 1, f"{name}: one Service")
            (sp,) = svcs[0]["spec"]["ports"]
            self.assertEqual((sp["targetPort"], sp["port"]), ("http", http), name)
            # wpubd (training pods) -> the engine's HTTP port; NCCL both ways and among engines.
            got = admitted(engine_policy, trainer_labels)
            self.assertTrue(covers(got, "http", number=http), f"{name}: wpubd -> http")
            self.assertTrue(covers(got, lo=EPHEMERAL[0], hi=EPHEMERAL[1]), name)
            self.assertTrue(covers(admitted(engine_policy, labels), lo=EPHEMERAL[0],
                                   hi=EPHEMERAL[1]), f"{name}: engine <-> engine NCCL")
            self.assertFalse(covers(admitted(engine_policy, {"app": "other"}), "http",
                                    number=http), f"{name}: an unrelated pod is not admitted")
            # Default-deny-egress namespaces: both directions listed.
            out = admitted(egress["wpubd-egress-to-engines"], labels)
            self.assertTrue(covers(out, "http", number=http), name)
            self.assertTrue(covers(out, lo=EPHEMERAL[0], hi=EPHEMERAL[1]), name)
            back = admitted(egress["rollout-engines-egress-to-wpubd"], trainer_labels)
            for store in ("nccl-store", "nccl-store-vllm"):
                self.assertTrue(covers(back, store), f"{name}: egress to {store}")
            self.assertTrue(covers(back, lo=EPHEMERAL[0], hi=EPHEMERAL[1]), name)
            self.assertTrue(selector_matches(
                egress["rollout-engines-egress-to-wpubd"]["spec"]["podSelector"], labels))
            argv = c.get("command", []) + c.get("args", [])
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "sglang.launch_server" in argv:
                families["sglang"] = name
                self.assertIn("--host=0.0.0.0", argv, name)
                self.assertIn(f"--port={http}", argv, name)
            elif argv[:2] == ["vllm", "serve"]:
                families["vllm"] = name
                self.assertEqual(env.get("VLLM_SERVER_DEV_MODE"), "1", name)
                i = argv.index("--weight-transfer-config")
                self.assertEqual(json.loads(argv[i + 1]), {"backend": "nccl"}, name)
                self.assertIn(f"--port={http}", argv, name)
            else:
                self.fail(f"{name}: neither SGLang nor vLLM: {argv}")
            self.assertIn("nvidia.com/gpu", c["resources"]["requests"], name)
        self.assertEqual(set(families), {"sglang", "vllm"})
        # The base does not list the examples.
        with open(os.path.join(K8S, "base", "kustomization.yaml")) as f:
            self.assertFalse([r for r in yaml.safe_load(f)["resources"] if "examples" in r])

    def test_same_as_kustomize(self):
        """Where kustomize (or kubectl) is installed, its output is what this test checks."""
        cmd = _kustomize()
        if cmd is None:
            self.skipTest("neither kustomize nor kubectl is installed; render() stands in")
        dirs = {name: os.path.join(K8S, "base") if name == "base" else os.path.join(
            K8S, "overlays", name) for name in self.layouts()}
        dirs["examples"] = EXAMPLES
        for name, path in dirs.items():
            objects = render(path)
            out = subprocess.run(cmd + [path], capture_output=True, text=True, check=True).stdout
            real = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}
            mine = {(o["kind"], o["metadata"]["name"]): o for o in objects}
            self.assertEqual(set(real), set(mine), name)
            for key, o in mine.items():
                if key[0] in ("ConfigMap", "Secret"):
                    continue  # kustomize writes a Secret's data base64-encoded
                self.assertEqual(real[key]["spec"], o["spec"], f"{name}: {key}")
                self.assertEqual(real[key]["metadata"], o["metadata"], f"{name}: {key}")

    def start_layout_daemon(self, name, objects, d):
        """A real wpubd with the layout's flag file and later args, as the container runs it:
        addresses moved to free loopback ports (or a temporary socket), the token to a temp
        file, $(POD_IP) expanded as the kubelet does. The flags stay as they are otherwise;
        on a build without the GPU path, or on a host without a usable GPU (CI), wpubd must
        refuse --gpu_path for exactly that reason, and is then started without it. Returns (daemon, rewrite), rewrite mapping the pod's
        paths to the temporary ones."""
        by_kind = _by_kind(objects)
        job, cfg = by_kind["Job"][0], by_kind["ConfigMap"][0]
        wpubd = _pod_spec(job)["initContainers"][0]
        flags, config_path, overrides = effective_flags(wpubd, cfg)
        token = os.path.join(d, "token")
        with open(token, "w") as f:  # what the operator's Secret holds
            f.write(secrets.token_hex(32) + "\n")
        rewrite = {flags["--auth_token_file"]: token}
        listen = flags["--listen"]
        if listen.startswith("unix:"):
            rewrite[os.path.dirname(listen[len("unix:"):])] = d
        pod_env = {"POD_IP": "127.0.0.1"}  # status.podIP
        text = cfg["data"][os.path.basename(config_path)]
        for flag, value in (("--listen", "127.0.0.1:0"), ("--metrics_listen", "127.0.0.1:0"),
                            ("--nccl_store_listen", "127.0.0.1:0"),
                            ("--auth_token_file", token),
                            ("--group_decision_log", os.path.join(d, "group-decisions.jsonl"))):
            text, n = re.subn(rf"^{flag}=\S+$", f"{flag}={value}", text, flags=re.M)
            self.assertEqual(n, 1, f"{name}: {flag} in the flag file")

        def moved(arg):
            arg = _expand(arg, pod_env)
            for old, new in rewrite.items():
                arg = arg.replace(old, new)
            return arg

        args = [moved(a) for a in overrides]
        self.assertFalse([a for a in args if "$(" in a], f"{name}: unexpanded {args}")
        listen_here = moved(listen) if listen.startswith("unix:") else "127.0.0.1:0"
        for attempt in ("as shipped", "without --gpu_path"):
            flagfile = os.path.join(d, "wpubd.flags")
            with open(flagfile, "w") as f:
                f.write(text)
            try:
                return _Daemon(d, f"--config={flagfile}", *args, metrics="127.0.0.1:0",
                               listen=listen_here), rewrite
            except RuntimeError as e:
                no_gpu_path = ("built without CUDA" in str(e) or
                               re.search(r"NCCL transport: CUDA device \d+ is not usable",
                                         str(e)))
                if attempt != "as shipped" or not no_gpu_path:
                    raise
                text, n = re.subn(r"^--gpu_path=true\n", "", text, flags=re.M)
                self.assertEqual(n, 1)
        raise AssertionError("unreachable")

    def test_sidecar_flags_start_a_real_wpubd(self):
        """Every layout's flags are accepted by wpubd (names and values), and the trainer's
        environment reaches it: wpub.Publisher.from_env() with the trainer container's env
        (paths moved to temp files) gets the daemon's status with the token. For the Unix
        socket layout, the probes' wpubctl commands pass against it and fail once it stops."""
        for name, objects in self.layouts().items():
            with self.subTest(layout=name):
                d = tempfile.mkdtemp(prefix="wpub-k8s-")
                daemon = None
                try:
                    daemon, rewrite = self.start_layout_daemon(name, objects, d)
                    self.assertGreater(daemon.metrics_port, 0)
                    job = [o for o in objects if o["kind"] == "Job"][0]
                    wpubd = _pod_spec(job)["initContainers"][0]
                    trainer = _pod_spec(job)["containers"][0]
                    env = {}
                    for e in trainer["env"]:
                        value = e["value"]
                        for old, new in rewrite.items():
                            value = value.replace(old, new)
                        env[e["name"]] = value
                    if not env["WPUB_TARGET"].startswith("unix:"):
                        self.assertGreater(daemon.port, 0)
                        env["WPUB_TARGET"] = f"127.0.0.1:{daemon.port}"
                    pub = wpub.Publisher.from_env(environ=env)
                    try:
                        self.assertEqual(pub.target, env["WPUB_TARGET"])
                        self.assertEqual(pub.status().committed_version, 0)
                    finally:
                        pub.close()
                    if "exec" in wpubd["readinessProbe"]:
                        probes = [wpubd[p]["exec"]["command"] for p in
                                  ("startupProbe", "readinessProbe", "livenessProbe")]
                        runs = [[binary("WPUBCTL")] + [self.moved(a, rewrite) for a in c[1:]]
                                for c in probes]
                        for cmd in runs:
                            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                            self.assertEqual(r.returncode, 0, f"{cmd}: {r.stdout}{r.stderr}")
                    else:
                        runs = []
                        for p in ("startupProbe", "readinessProbe", "livenessProbe"):
                            service = wpubd[p]["grpc"].get("service", "")
                            with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as ch:
                                self.assertEqual(health(ch, service), SERVING, f"{p} {service}")
                    code = daemon.stop()
                    self.assertEqual(code, 0, daemon.log())
                    for cmd in runs:
                        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
                        self.assertNotEqual(r.returncode, 0, f"{cmd} passes without wpubd")
                finally:
                    if daemon is not None:
                        daemon.stop()
                    shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def moved(arg, rewrite):
        for old, new in rewrite.items():
            arg = arg.replace(old, new)
        return arg


def _kustomize():
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def health(channel, service: str = "", timeout: float = 5.0) -> bytes:
    """grpc.health.v1.Health/Check for `service` (what a Kubernetes gRPC probe sends)."""
    name = service.encode()
    request = (b"\x0a" + bytes([len(name)]) + name) if name else b""
    call = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                               response_deserializer=None)
    return call(request, timeout=timeout)


SERVING = b"\x08\x01"  # HealthCheckResponse{status: SERVING}


class KubernetesSchemaTest(unittest.TestCase):
    """Every object the manifests render, validated against tests/deploy/schemas (a JSON
    Schema subset of the Kubernetes API for the kinds deploy/k8s uses; unknown fields are
    refused at every level it covers), and broken objects refused where they break."""

    @classmethod
    def setUpClass(cls):
        try:
            import jsonschema
        except ImportError:
            raise unittest.SkipTest("python3-jsonschema is not installed (Debian package)")
        cls.jsonschema = jsonschema
        with open(SCHEMA) as f:
            cls.schema = json.load(f)
        jsonschema.Draft202012Validator.check_schema(cls.schema)

    def validator(self, definition: str):
        self.assertIn(definition, self.schema["$defs"], f"no schema for {definition}")
        schema = dict(self.schema, **{"$ref": f"#/$defs/{definition}"})
        return self.jsonschema.Draft202012Validator(schema)

    def errors(self, obj):
        kind = obj.get("kind")
        self.assertIn(kind, self.schema["kinds"], f"no schema for kind {kind}")
        return list(self.validator(self.schema["kinds"][kind]).iter_errors(obj))

    def assert_valid(self, obj, where):
        errs = self.errors(obj)
        self.assertFalse(errs, f"{where}: {obj['kind']} {obj['metadata'].get('name')}: " +
                         "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errs[:5]))

    def all_objects(self):
        out = [("base", o) for o in render(os.path.join(K8S, "base"))]
        for name in sorted(os.listdir(os.path.join(K8S, "overlays"))):
            out += [(name, o) for o in render(os.path.join(K8S, "overlays", name))]
        out += [("examples", o) for o in render(EXAMPLES)]
        listed = {o["metadata"]["name"] for where, o in out if where == "examples"}
        for fname in sorted(os.listdir(EXAMPLES)):
            if fname.endswith(".yaml") and fname != "kustomization.yaml":
                with open(os.path.join(EXAMPLES, fname)) as f:
                    out += [(fname, o) for o in yaml.safe_load_all(f)
                            if o and o["metadata"]["name"] not in listed]
        return out

    def test_rendered_objects_validate(self):
        objects = self.all_objects()
        kinds = {o["kind"] for _, o in objects}
        self.assertTrue({"Job", "Deployment", "Service", "NetworkPolicy", "ConfigMap",
                         "PodMonitor", "PrometheusRule"} <= kinds, kinds)
        self.assertNotIn("Secret", kinds, "no Secret (a token) is shipped")
        for where, o in objects:
            with self.subTest(where=where, kind=o["kind"], name=o["metadata"]["name"]):
                self.assert_valid(o, where)
        with open(os.path.join(DEPLOY, "prometheus", "wpub-alerts.rules.yml")) as f:
            rules = yaml.safe_load(f)
        errs = list(self.validator("RulesFile").iter_errors(rules))
        self.assertFalse(errs, [e.message for e in errs])

    def test_kustomize_output_validates(self):
        cmd = _kustomize()
        if cmd is None:
            self.skipTest("neither kustomize nor kubectl is installed")
        dirs = [os.path.join(K8S, "base"), EXAMPLES] + [
            os.path.join(K8S, "overlays", n) for n in sorted(os.listdir(
                os.path.join(K8S, "overlays")))]
        for path in dirs:
            out = subprocess.run(cmd + [path], capture_output=True, text=True, check=True).stdout
            for o in yaml.safe_load_all(out):
                if o:
                    with self.subTest(path=path, kind=o["kind"]):
                        self.assert_valid(o, path)

    def test_broken_objects_are_rejected(self):
        """Each mutation of a valid rendered object is refused, with an error at (or under)
        the path it broke."""
        base = {o["kind"]: o for o in render(os.path.join(K8S, "base"))}
        engine = [o for o in render(EXAMPLES) if o["kind"] == "Deployment"][0]
        pod = ["spec", "template", "spec"]
        sidecar = pod + ["initContainers", 0]
        trainer = pod + ["containers", 0]

        def at(obj, path):
            for p in path:
                obj = obj[p]
            return obj

        def setter(path, key, value):
            return lambda o: at(o, path).__setitem__(key, value)

        def deleter(path, key):
            return lambda o: at(o, path).__delitem__(key)

        cases = [
            ("unknown container field", "Job", setter(sidecar, "imagePullPolcy", "Always"),
             sidecar),
            ("restartPolicy on a regular container", "Job",
             setter(trainer, "restartPolicy", "Always"), trainer),
            ("port name over 15 characters", "Job",
             setter(sidecar + ["ports", 0], "name", "nccl-store-vllm-x"),
             sidecar + ["ports", 0, "name"]),
            ("port name with upper case", "Job", setter(sidecar + ["ports", 0], "name", "GRPC"),
             sidecar + ["ports", 0, "name"]),
            ("containerPort as a string", "Job",
             setter(sidecar + ["ports", 0], "containerPort", "50151"),
             sidecar + ["ports", 0, "containerPort"]),
            ("unknown port field", "Job", setter(sidecar + ["ports", 0], "port", 50151),
             sidecar + ["ports", 0]),
            ("env value and valueFrom", "Job", setter(sidecar + ["env", 0], "value", "1.2.3.4"),
             sidecar + ["env", 0]),
            ("misspelt env field", "Job", setter(trainer + ["env", 0], "valu", "x"),
             trainer + ["env", 0]),
            ("env value not a string", "Job", setter(trainer + ["env", 0], "value", 50151),
             trainer + ["env", 0, "value"]),
            ("misspelt volumeMount field", "Job",
             setter(sidecar + ["volumeMounts", 0], "readonly", True),
             sidecar + ["volumeMounts", 0]),
            ("relative mountPath", "Job",
             setter(sidecar + ["volumeMounts", 0], "mountPath", "dev/shm"),
             sidecar + ["volumeMounts", 0, "mountPath"]),
            ("probe with two handlers", "Job",
             setter(sidecar + ["startupProbe"], "tcpSocket", {"port": 50151}),
             sidecar + ["startupProbe"]),
            ("misspelt probe field", "Job",
             setter(sidecar + ["livenessProbe"], "periodSecond", 10),
             sidecar + ["livenessProbe"]),
            ("malformed quantity", "Job",
             setter(trainer + ["resources", "requests"], "cpu", "16 cores"),
             trainer + ["resources", "requests", "cpu"]),
            ("volume with two sources", "Job",
             setter(pod + ["volumes", 0], "configMap", {"name": "x"}), pod + ["volumes", 0]),
            ("Job pod restartPolicy Always", "Job", setter(pod, "restartPolicy", "Always"),
             pod + ["restartPolicy"]),
            ("misspelt pod field", "Job", setter(pod, "shareProcessNamespaces", True), pod),
            ("misspelt Job field", "Job", setter(["spec"], "completion", 2), ["spec"]),
            ("label value over 63 characters", "Job",
             setter(["metadata", "labels"], "app.kubernetes.io/name", "x" * 64),
             ["metadata", "labels", "app.kubernetes.io/name"]),
            ("metadata without a name", "ConfigMap", deleter(["metadata"], "name"),
             ["metadata"]),
            ("misspelt Secret field", "Secret", setter([], "strinData", {"a": "b"}), []),
            ("Service port without port", "Service", deleter(["spec", "ports", 0], "port"),
             ["spec", "ports", 0]),
            ("Service targetPort not a port", "Service",
             setter(["spec", "ports", 0], "targetPort", "-grpc"),
             ["spec", "ports", 0, "targetPort"]),
            ("NetworkPolicy endPort on a named port", "NetworkPolicy",
             setter(["spec", "ingress", 0, "ports", 0], "endPort", 60000),
             ["spec", "ingress", 0, "ports", 0]),
            ("NetworkPolicy peer with a misspelt selector", "NetworkPolicy",
             setter(["spec", "ingress", 0, "from", 0], "podSelectors", {}),
             ["spec", "ingress", 0, "from", 0]),
            ("NetworkPolicy unknown policy type", "NetworkPolicy",
             setter(["spec"], "policyTypes", ["Ingres"]), ["spec", "policyTypes", 0]),
            ("PodMonitor port as a number", "PodMonitor",
             setter(["spec", "podMetricsEndpoints", 0], "port", 9464),
             ["spec", "podMetricsEndpoints", 0, "port"]),
            ("PrometheusRule rule without expr", "PrometheusRule",
             deleter(["spec", "groups", 0, "rules", 0], "expr"),
             ["spec", "groups", 0, "rules", 0]),
            ("PrometheusRule for not a duration", "PrometheusRule",
             setter(["spec", "groups", 0, "rules", 0], "for", "15 minutes"),
             ["spec", "groups", 0, "rules", 0, "for"]),
            ("Deployment pod restartPolicy Never", "Deployment",
             setter(pod, "restartPolicy", "Never"), pod + ["restartPolicy"]),
            ("Deployment without a selector", "Deployment", deleter(["spec"], "selector"),
             ["spec"]),
        ]
        # The Secret the operator creates (not shipped): what the schema must accept and refuse.
        operator_secret = {"apiVersion": "v1", "kind": "Secret",
                           "metadata": {"name": "wpubd-token"}, "stringData": {"token": "x"}}
        for what, kind, mutate, path in cases:
            with self.subTest(broken=what):
                original = (engine if kind == "Deployment" else
                            operator_secret if kind == "Secret" else base[kind])
                self.assert_valid(original, "unmodified")
                obj = copy.deepcopy(original)
                mutate(obj)
                errs = self.errors(obj)
                self.assertTrue(errs, f"{what}: accepted")
                paths = []

                def walk(es):
                    for e in es:
                        paths.append(list(e.absolute_path))
                        walk(e.context)
                walk(errs)
                self.assertTrue([p for p in paths if p[:len(path)] == path],
                                f"{what}: no error at {path}: {paths}")


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
            # Type=notify: wpubd's own process sends READY=1 (test_wpubd_notifies_ready...).
            self.assertIn("Type=notify", directives)
            self.assertIn("NotifyAccess=main", directives)
            # The trainer's group reaches the socket in the RuntimeDirectory: the directory is
            # group-searchable, sockets are created group-writable (connect needs write), and
            # others get nothing.
            values = dict(l.split("=", 1) for l in directives if "=" in l)
            self.assertNotEqual(values["Group"], values["User"], "the trainers' group")
            self.assertEqual(values["RuntimeDirectory"], "wpub")
            dir_mode, umask = int(values["RuntimeDirectoryMode"], 8), int(values["UMask"], 8)
            self.assertEqual(dir_mode & 0o070, 0o050, "group r-x on /run/wpub")
            self.assertEqual(dir_mode & 0o007, 0, "nothing for others on /run/wpub")
            self.assertEqual(0o777 & ~umask & 0o070, 0o070, "sockets group-writable")
            self.assertEqual(0o777 & ~umask & 0o007, 0, "nothing for others")
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
            # The env file's Unix socket lies in the unit's RuntimeDirectory.
            socket_lines = re.findall(r"--listen=unix:(\S+)", env)
            self.assertTrue(socket_lines)
            for path in socket_lines:
                self.assertEqual(os.path.dirname(path), "/run/" + values["RuntimeDirectory"])
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

    def test_wpubd_notifies_ready_from_its_main_process(self):
        """What Type=notify with NotifyAccess=main relies on: wpubd sends READY=1 to
        $NOTIFY_SOCKET from its own PID once both listeners accept connections (and STOPPING=1
        when it begins to drain); without it systemd would kill it at TimeoutStartSec."""
        wpubd = binary("WPUBD")
        with open(wpubd, "rb") as f:
            image = f.read()
        if b"READY=1" not in image:
            self.skipTest(f"{wpubd} does not call sd_notify (built before Type=notify support)")
        d = tempfile.mkdtemp(prefix="wpub-notify-")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        proc = None
        log = open(os.path.join(d, "wpubd.log"), "ab")
        try:
            path = os.path.join(d, "notify")
            sock.bind(path)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.settimeout(60)
            port, metrics_port = free_port(), free_port()
            proc = subprocess.Popen(
                [wpubd, f"--listen=127.0.0.1:{port}", f"--metrics_listen=127.0.0.1:{metrics_port}",
                 "--log_level=warn"], env=dict(os.environ, NOTIFY_SOCKET=path),
                stdout=log, stderr=subprocess.STDOUT)

            def receive():
                data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(12))
                pids = [struct.unpack("iII", c[:12])[0] for level, kind, c in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
                self.assertEqual(len(pids), 1, data)
                return data.decode().split("\n"), pids[0]

            fields, pid = receive()
            self.assertIn("READY=1", fields)
            self.assertEqual(pid, proc.pid, "sent by the main process (NotifyAccess=main)")
            for p in (port, metrics_port):
                socket.create_connection(("127.0.0.1", p), timeout=5).close()
            proc.terminate()
            if b"STOPPING=1" in image:
                fields, pid = receive()
                self.assertIn("STOPPING=1", fields)
                self.assertEqual(pid, proc.pid)
            self.assertEqual(proc.wait(60), 0)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            sock.close()
            log.close()
            shutil.rmtree(d, ignore_errors=True)

    def test_socket_mode_under_the_units_umask(self):
        """wpubd started with the unit's UMask creates its Unix socket group read-write and
        closed to others (what lets the trainers' group, and only it, connect)."""
        wpubd = binary("WPUBD")
        with open(os.path.join(DEPLOY, "systemd", "wpubd.service")) as f:
            umask = int(re.search(r"^UMask=(\S+)$", f.read(), re.M).group(1), 8)
        d = tempfile.mkdtemp(prefix="wpub-umask-")
        proc = None
        try:
            sock, ready = os.path.join(d, "wpubd.sock"), os.path.join(d, "ready.json")
            with open(os.path.join(d, "wpubd.log"), "ab") as log:
                proc = subprocess.Popen(
                    [wpubd, f"--listen=unix:{sock}", "--metrics_listen=", f"--ready_file={ready}",
                     "--log_level=warn"], stdout=log, stderr=subprocess.STDOUT,
                    umask=umask)
            deadline = time.monotonic() + 30
            while not os.path.exists(ready):  # written once the listener is bound
                self.assertIsNone(proc.poll(), "wpubd exited")
                self.assertLess(time.monotonic(), deadline, "wpubd did not become ready")
                time.sleep(0.02)
            self.assertEqual(os.stat(sock).st_mode & 0o777, 0o777 & ~umask)
            self.assertEqual(os.stat(sock).st_mode & 0o077, 0o070)
            proc.terminate()
            self.assertEqual(proc.wait(60), 0)
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
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

    def instructions(self, name="Dockerfile"):
        with open(os.path.join(DEPLOY, name)) as f:
            text = re.sub(r"\\\n", " ", f.read())
        out = []
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                word, _, rest = line.partition(" ")
                out.append((word.upper(), rest.strip()))
        return out

    def test_nccl_overlay_puts_the_engines_nccl_first(self):
        # Dockerfile.nccl: the engine image's libnccl.so.2 beside wpubd, first on the linker's
        # path; nothing run, the wpubd image's user and entrypoint kept.
        ins = self.instructions("Dockerfile.nccl")
        self.assertEqual({w for w, _ in ins}, {"ARG", "FROM", "COPY", "ENV"})
        froms = [r for w, r in ins if w == "FROM"]
        self.assertEqual(froms, ["${ENGINE_IMAGE} AS engine", "${WPUBD_IMAGE}"])
        copies = [r.split() for w, r in ins if w == "COPY"]
        self.assertEqual(len(copies), 1)
        self.assertEqual(copies[0][0], "--from=engine")
        self.assertTrue(copies[0][1].endswith("/libnccl.so.2"), copies)
        dest = os.path.dirname(copies[0][2])
        self.assertIn(f"LD_LIBRARY_PATH={dest}", [r for w, r in ins if w == "ENV"])
        self.assertFalse([r for w, r in ins if w == "USER"])

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
        wpubd = _pod_spec(job)["initContainers"][0]
        self.assertEqual(exposed, {p["containerPort"] for p in wpubd["ports"]})
        self.assertTrue({50151, 9464, 29510, 29511} <= exposed, exposed)
        entry = [r for w, r in runtime if w == "ENTRYPOINT"][-1]
        self.assertEqual(yaml.safe_load(entry), ["/opt/wpub/bin/wpubd"])
        with open(os.path.join(DEPLOY, "bundle.sh")) as f:
            self.assertIn('"$root/bin/$b"', f.read(), "the bundle provides bin/wpubd")


if __name__ == "__main__":
    unittest.main()

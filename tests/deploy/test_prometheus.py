"""A real Prometheus (Debian's /usr/bin/prometheus) scrapes a real wpubd with the shipped
scrape config (deploy/prometheus/prometheus.yml, target and intervals rewritten) and evaluates
the shipped alert rules: the values it stores equal the daemon's publication reports, every
PromQL expression of the shipped Grafana dashboard (with its $job and $instance variables, one
instance and All) returns data from it, every alert rule evaluates without error on the real
series and exactly the alerts this scenario implies are active.

The dashboard and the rules use metrics that came with the operations work (NEW_METRICS): an
expression on one of them must return data once the daemon under test exports it; against an
older wpubd it must still be valid PromQL, and the test says which ones it could not check
(skipped subtests naming the missing metrics)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import urllib.request
from datetime import datetime

import yaml

from deploy_util import DEPLOY, Daemon, binary, free_port, tiny_batches
import wpub  # noqa: E402 (deploy_util puts clients/python on sys.path)
from harness import wait_idle  # noqa: E402 (tests/python, on sys.path through deploy_util)

PROMETHEUS = os.environ.get("WPUB_PROMETHEUS", "/usr/bin/prometheus")
RULES = os.path.join(DEPLOY, "prometheus", "wpub-alerts.rules.yml")
SCRAPE = "1s"
# What the dashboard's Grafana variables stand for when its expressions are run here ($instance
# is set per run: the daemon's target, regex-escaped as Grafana does, and All's ".*").
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "10m", "$job": "wpubd"}
# Metric families added for operating wpub (build, process, in-flight publication, per
# receiver, every attempt's wall clock). Queries on them are checked for data only where the
# daemon under test exports them.
NEW_METRICS = {
    "wpub_build_info", "process_cpu_seconds_total", "process_resident_memory_bytes",
    "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
    "process_start_time_seconds", "wpub_publication_in_flight",
    "wpub_publication_in_flight_version", "wpub_publication_in_flight_age_seconds",
    "wpub_publication_in_flight_bytes", "wpub_receiver_last_committed_version",
    "wpub_receiver_state", "wpub_receiver_failures_total", "wpub_publication_attempt_seconds"}
METRIC_NAME = re.compile(r"\b((?:wpub|process)_[a-z0-9_]+|up)\b(\{[^}]*\})?")


def _rfc3339(text: str) -> float:
    """Seconds since the epoch of Prometheus' RFC 3339 timestamps (nanoseconds, Z)."""
    m = re.fullmatch(r"(.*T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", text)
    assert m, text
    base = datetime.fromisoformat(m.group(1) + (m.group(3).replace("Z", "+00:00")))
    return base.timestamp() + float(m.group(2) or 0)


class PrometheusTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(PROMETHEUS):
            raise unittest.SkipTest(f"{PROMETHEUS} is missing (Debian package prometheus)")
        cls.dir = tempfile.mkdtemp(prefix="wpub-prom-")
        cls.daemon = Daemon(cls.dir, "--commit_deadline=30s", metrics="127.0.0.1:0")
        cls.recv = None
        cls.bad_recv = None
        cls.prom = None
        try:
            cls.recv_log = open(os.path.join(cls.dir, "recv.log"), "ab")
            cls.recv = subprocess.Popen(
                [binary("WPUB_RECV"), f"--target={cls.daemon.target}", "--name=engine-0",
                 "--log_level=warn"], stdout=cls.recv_log, stderr=subprocess.STDOUT)
            cls.start_prometheus()
            cls.publish()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def start_prometheus(cls):
        with open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")) as f:
            config = yaml.safe_load(f)
        config["global"]["scrape_interval"] = SCRAPE
        config["global"]["evaluation_interval"] = SCRAPE
        jobs = [j for j in config["scrape_configs"] if j["job_name"] == "wpubd"]
        assert len(jobs) == 1, "the shipped config has one wpubd job"
        jobs[0]["scrape_interval"] = SCRAPE
        jobs[0]["scrape_timeout"] = SCRAPE
        jobs[0]["static_configs"][0]["targets"] = [f"127.0.0.1:{cls.daemon.metrics_port}"]
        # The shipped rules, by absolute path (the copy lives elsewhere).
        assert config["rule_files"] == [os.path.basename(RULES)], config["rule_files"]
        config["rule_files"] = [RULES]
        path = os.path.join(cls.dir, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        port = free_port()
        cls.api = f"http://127.0.0.1:{port}/api/v1/"
        cls.prom_log = open(os.path.join(cls.dir, "prometheus.log"), "ab")
        cls.prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={path}", f"--storage.tsdb.path={cls.dir}/tsdb",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=cls.prom_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if cls.prom.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("prometheus did not become ready: " + cls.prom_tail())
            time.sleep(0.2)

    @classmethod
    def prom_tail(cls):
        with open(os.path.join(cls.dir, "prometheus.log"), "rb") as f:
            return f.read().decode(errors="replace")[-3000:]

    @classmethod
    def publish(cls):
        """Three committed versions from wpubctl, then one aborted by a corrupting receiver."""
        pub = wpub.Publisher(cls.daemon.target)
        deadline = time.monotonic() + 20
        while len(pub.status().receivers) < 1:
            if time.monotonic() > deadline:
                raise RuntimeError("wpub-recv did not subscribe")
            time.sleep(0.05)
        r = subprocess.run(
            [binary("WPUBCTL"), "publish-synthetic", f"--target={cls.daemon.target}",
             "--model_style=qwen3_moe", "--num_layers=2", "--num_experts=4",
             "--hidden_size=128", "--moe_intermediate_size=64", "--intermediate_size=256",
             "--vocab_size=512", "--count=3"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        # A second receiver corrupts its first bucket: the next publication aborts and the
        # engine failure is counted.
        cls.bad_recv = subprocess.Popen(
            [binary("WPUB_RECV"), f"--target={cls.daemon.target}", "--name=engine-bad",
             "--corrupt_bucket=0", "--log_level=warn"],
            stdout=cls.recv_log, stderr=subprocess.STDOUT)
        while len(pub.status().receivers) < 2:
            if time.monotonic() > deadline + 20:
                raise RuntimeError("the second wpub-recv did not subscribe")
            time.sleep(0.05)
        # As the leader of a group of one: the group's series exist too.
        report = pub.publish(4, tiny_batches(), check=False, group=wpub.GroupSpec("solo", 1, 0))
        assert report.status == "ABORTED", report
        wait_idle(pub)  # the abort's teardown runs after the RPC returned
        cls.reports = pub.list_reports(limit=100)
        cls.receivers = pub.status().receivers
        pub.close()
        # Every metric of this scenario is final from here: a scrape that starts later holds
        # all of them.
        cls.settled_at = time.time()

    @classmethod
    def tearDownClass(cls):
        if cls.prom is not None and cls.prom.poll() is None:
            cls.prom.send_signal(signal.SIGTERM)
            try:
                cls.prom.wait(30)
            except subprocess.TimeoutExpired:
                cls.prom.kill()
                cls.prom.wait()
        for recv in (cls.recv, cls.bad_recv):
            if recv is not None and recv.poll() is None:
                recv.send_signal(signal.SIGTERM)
                recv.wait(20)
        code = cls.daemon.stop()
        shutil.rmtree(cls.dir, ignore_errors=True)
        assert code == 0, f"wpubd exit {code}"

    def query(self, expr: str):
        url = self.api + "query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        self.assertEqual(body["status"], "success", body)
        return body["data"]["result"]

    def values(self, expr: str, label: str = ""):
        """{label value: float} (or {"": float} without a label) of an instant query."""
        return {s["metric"].get(label, ""): float(s["value"][1]) for s in self.query(expr)}

    def wait_scraped(self) -> float:
        """Until Prometheus holds two scrapes that started after the scenario settled (every
        series of one scrape shares its timestamp; rates need two samples); returns the
        latest scrape's timestamp."""
        committed = [r for r in self.reports if r.status == "COMMITTED"]
        want = {"": float(max(r.version for r in committed))}
        total = float(len(self.reports))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            series = self.query('up{job="wpubd"}[5m]')
            after = [float(t) for s in series for t, _ in s["values"] if float(t) > self.settled_at]
            if len(after) >= 2:
                self.assertEqual(self.values("wpub_last_committed_version"), want)
                self.assertEqual(self.values("sum(wpub_publications_total)"), {"": total})
                return max(after)
            time.sleep(0.1)
        self.fail("Prometheus never scraped the final state: " + self.prom_tail())

    def api_get(self, path: str, **params):
        url = self.api + path + ("?" + urllib.parse.urlencode(params, doseq=True)
                                 if params else "")
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        self.assertEqual(body["status"], "success", body)
        return body["data"]

    def exported(self):
        """The metric families the daemon under test exports (its # TYPE lines)."""
        url = f"http://127.0.0.1:{self.daemon.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))

    def family(self, name: str, exported) -> str:
        for suffix in ("_bucket", "_sum", "_count"):
            base = name[:-len(suffix)]
            if name.endswith(suffix) and exported.get(base, "") in ("histogram", "summary"):
                return base
            if name.endswith(suffix) and base in NEW_METRICS:
                return base
        return name

    def test_scraped_values_equal_reports(self):
        self.wait_scraped()
        reports = self.reports
        committed = [r for r in reports if r.status == "COMMITTED"]
        self.assertEqual(len(committed), 3)
        self.assertEqual([r.status for r in reports if r.status != "COMMITTED"], ["ABORTED"])
        up = self.values('up{job="wpubd"}')
        self.assertEqual(up, {"": 1.0})

        by_status = self.values("wpub_publications_total", "status")
        for status in {r.status for r in reports}:
            self.assertEqual(by_status[status.lower()],
                             sum(1 for r in reports if r.status == status), status)
        self.assertEqual(sum(by_status.values()), len(reports))

        self.assertEqual(self.values("wpub_publication_seconds_count"), {"": 3.0})
        self.assertAlmostEqual(self.values("wpub_publication_seconds_sum")[""],
                               sum(r.wall_seconds for r in committed), places=6)
        self.assertEqual(self.values("wpub_host_syncs_total")[""],
                         float(sum(r.host_syncs for r in reports)))
        # The gauge holds the newest report's count (newest first in ListReports).
        self.assertEqual(self.values("wpub_publication_host_syncs")[""],
                         float(reports[0].host_syncs))

        by_format = self.values("wpub_published_bytes_total", "format")
        want = {}
        for r in committed:
            for fmt, n in r.bytes_out_by_format.items():
                want[fmt] = want.get(fmt, 0) + n
        self.assertGreater(want.get("nvfp4", 0), 0)
        for fmt, n in want.items():
            self.assertEqual(by_format[fmt], float(n), fmt)
        self.assertEqual(sum(by_format.values()), float(sum(r.bytes_out for r in committed)))

        tensors = self.values("wpub_tensors_total", "action")
        self.assertEqual(tensors["quantized"], float(sum(r.tensors_quantized for r in committed)))
        self.assertEqual(tensors["passthrough"],
                         float(sum(r.tensors_passthrough for r in committed)))
        for phase in ("ingest", "quantize", "transfer", "commit"):
            self.assertEqual(
                self.values(f'wpub_publication_phase_seconds_count{{phase="{phase}"}}'),
                {"": 3.0}, phase)
        engines = self.values("wpub_engines", "state")
        for state in {r.state for r in self.receivers}:
            self.assertEqual(engines[state],
                             float(sum(1 for r in self.receivers if r.state == state)), state)
        failures = self.values("wpub_engine_failures_total", "reason")
        want_failures = {}
        for r in reports:
            for o in r.receivers:
                if o.failure != "none":
                    want_failures[o.failure] = want_failures.get(o.failure, 0) + 1
        self.assertTrue(want_failures, "the corrupting receiver failed a publication")
        for reason, n in want_failures.items():
            self.assertEqual(failures[reason], float(n), reason)
        self.assertEqual(sum(failures.values()), float(sum(want_failures.values())))

    def test_dashboard_expressions_return_data(self):
        self.wait_scraped()
        with open(os.path.join(DEPLOY, "grafana", "wpub-dashboard.json")) as f:
            dashboard = json.load(f)
        exprs = []
        for panel in dashboard["panels"]:
            targets = panel.get("targets", [])
            self.assertTrue(targets, f"panel '{panel['title']}' has no query")
            for t in targets:
                exprs.append((panel["title"], t["expr"]))
        self.assertGreaterEqual(len(exprs), 10)
        titles = " ".join(p["title"].lower() for p in dashboard["panels"])
        for topic in ("status", "p50", "p99", "phase", "host syncs", "bytes", "engines",
                      "failures", "last committed version", "group", "laggard receivers",
                      "in flight"):
            self.assertIn(topic, titles)
        # Every metric of every query is filtered by the dashboard's $job and $instance.
        for title, expr in exprs:
            selectors = METRIC_NAME.findall(expr)
            self.assertTrue(selectors, f"{title}: no metric in {expr}")
            for metric, matchers in selectors:
                for var in ('job=~"$job"', 'instance=~"$instance"'):
                    self.assertIn(var, matchers, f"{title}: {metric} without {var}")
        exported = self.exported()
        instance = f"127.0.0.1:{self.daemon.metrics_port}"
        pending = set()
        for title, expr in exprs:
            names = {self.family(m, exported) for m, _ in METRIC_NAME.findall(expr)} - {"up"}
            missing = names - set(exported)
            # A metric that is neither exported nor one of the new ones is a misspelling.
            self.assertLessEqual(missing, NEW_METRICS, f"{title}: unknown metrics in {expr}")
            for value in (re.escape(instance).replace("\\", "\\\\"), ".*"):
                q = expr.replace("$instance", value)
                for var, sub in GRAFANA_VARS.items():
                    q = q.replace(var, sub)
                self.assertNotIn("$", q, f"{title}: unknown Grafana variable in {expr}")
                with self.subTest(panel=title, expr=expr, instance=value):
                    result = self.query(q)  # valid PromQL in every case
                    if missing:
                        pending.add(title)
                        self.skipTest(f"needs {sorted(missing)}, not exported by this wpubd")
                    self.assertTrue(result, f"panel '{title}': no data for {q}")
                    for series in result:
                        if "instance" in series["metric"]:
                            self.assertEqual(series["metric"]["instance"], instance)
        if pending:
            print(f"\ndashboard panels not checked for data (metrics missing): {sorted(pending)}",
                  file=sys.stderr)
        # The template variables' own queries: label_values(metric{selector}, label).
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        want = {"job": "wpubd", "instance": instance}
        for name, value in want.items():
            var = variables[name]
            self.assertTrue(var["multi"] and var["includeAll"], name)
            self.assertEqual(var["allValue"], ".*", name)
            m = re.fullmatch(r"label_values\((\w+(?:\{[^}]*\})?), *(\w+)\)", var["definition"])
            self.assertTrue(m, var["definition"])
            self.assertEqual(var["query"]["query"], var["definition"])
            self.assertEqual(m.group(2), name)
            selector = m.group(1).replace("$job", GRAFANA_VARS["$job"])
            self.assertNotIn("$", selector)
            self.assertIn(value, self.api_get(f"label/{name}/values", **{"match[]": selector}))
        self.assertIn('job=~"$job"', variables["instance"]["definition"],
                      "the instances follow the jobs picked")

    def test_alert_rules_evaluate_on_real_series(self):
        """Prometheus evaluates the shipped rules on this daemon's series after the final
        scrape: every rule is healthy, and the active alerts are exactly what the scenario
        implies: engine-bad subscribed after v3 committed and applied nothing since (v4
        aborted), so WpubReceiverBehind is pending for it (for: 10m) where the daemon exports
        per-receiver versions; nothing else (commits, 4 publications are below the failure
        rate's minimum, no baseline hour, target up, nothing in flight)."""
        scraped = self.wait_scraped()
        with open(RULES) as f:
            names = {r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]
                     if "alert" in r}
        deadline = time.monotonic() + 30
        while True:
            groups = self.api_get("rules")["groups"]
            rules = [r for g in groups for r in g["rules"]]
            if (groups and all(_rfc3339(g["lastEvaluation"]) > scraped for g in groups)):
                break
            self.assertLess(time.monotonic(), deadline, f"rules not evaluated: {groups}")
            time.sleep(0.1)
        self.assertEqual({r["name"] for r in rules}, names)
        for r in rules:
            self.assertEqual((r["health"], r.get("lastError", "")), ("ok", ""), r["name"])
        active = {(a["labels"]["alertname"], a["labels"].get("receiver", ""), a["state"])
                  for a in self.api_get("alerts")["alerts"]}
        want = set()
        if "wpub_receiver_last_committed_version" in self.exported():
            behind = {r.name for r in self.receivers if r.last_committed_version < 3}
            self.assertEqual(behind, {"engine-bad"})
            want.add(("WpubReceiverBehind", "engine-bad", "pending"))
        else:
            print("\nWpubReceiverBehind not checked: this wpubd exports no "
                  "wpub_receiver_last_committed_version", file=sys.stderr)
        self.assertEqual(active, want)


if __name__ == "__main__":
    unittest.main()

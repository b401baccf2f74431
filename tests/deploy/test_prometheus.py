"""A real Prometheus (Debian's /usr/bin/prometheus) scrapes a real wpubd with the shipped
scrape config (deploy/prometheus/prometheus.yml, target and intervals rewritten): the values
it stores equal the daemon's publication reports, and every PromQL expression of the shipped
Grafana dashboard returns data from it."""

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import yaml

from deploy_util import DEPLOY, Daemon, binary, free_port, tiny_batches
import wpub  # noqa: E402 (deploy_util puts clients/python on sys.path)

PROMETHEUS = os.environ.get("WPUB_PROMETHEUS", "/usr/bin/prometheus")
SCRAPE = "1s"
# What the dashboard's Grafana variables stand for when its expressions are run here.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "10m", "$job": "wpubd"}


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
        cls.reports = pub.list_reports(limit=100)
        cls.receivers = pub.status().receivers
        pub.close()

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

    def wait_scraped(self):
        """Until Prometheus holds a scrape taken after every report was recorded."""
        committed = [r for r in self.reports if r.status == "COMMITTED"]
        want = {"": float(max(r.version for r in committed))}
        total = float(len(self.reports))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (self.values("wpub_last_committed_version") == want and
                    self.values("sum(wpub_publications_total)") == {"": total}):
                time.sleep(2 * float(SCRAPE[:-1]))  # one more scrape of every series
                return
            time.sleep(0.25)
        self.fail("Prometheus never scraped the final state: " + self.prom_tail())

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
                      "failures", "last committed version", "group"):
            self.assertIn(topic, titles)
        for title, expr in exprs:
            q = expr
            for var, value in GRAFANA_VARS.items():
                q = q.replace(var, value)
            self.assertNotIn("$", q, f"{title}: unknown Grafana variable in {expr}")
            with self.subTest(panel=title, expr=expr):
                result = self.query(q)
                self.assertTrue(result, f"panel '{title}': no data for {q}")
        # The $job variable's own query: label_values(metric, job).
        for var in dashboard["templating"]["list"]:
            m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var.get("definition", ""))
            if not m:
                continue
            url = (self.api + f"label/{m.group(2)}/values?" +
                   urllib.parse.urlencode({"match[]": m.group(1)}))
            with urllib.request.urlopen(url, timeout=10) as r:
                self.assertIn("wpubd", json.load(r)["data"])


if __name__ == "__main__":
    unittest.main()

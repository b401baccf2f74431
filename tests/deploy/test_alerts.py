"""The shipped alert rules (deploy/prometheus/wpub-alerts.rules.yml): `promtool check rules`,
the promtool unit tests of deploy/prometheus/wpub-alerts.test.yml (every alert has a case that
fires and one that must not), conventions (WpubXxx names, severity, summary and description,
`for:`), the PrometheusRule of deploy/k8s/base holding exactly the same groups, the shipped
scrape config loading the rules, and the unit tests failing when a rule is broken (each
mutation below must make promtool report the alert it broke)."""

import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

from deploy_util import DEPLOY

PROMTOOL = os.environ.get("WPUB_PROMTOOL", "/usr/bin/promtool")
PROM = os.path.join(DEPLOY, "prometheus")
RULES = os.path.join(PROM, "wpub-alerts.rules.yml")
TESTS = os.path.join(PROM, "wpub-alerts.test.yml")
PROMETHEUS_RULE = os.path.join(DEPLOY, "k8s", "base", "prometheusrule.yaml")

# (alert, what the mutation breaks, [(old text of its expr, new text, occurrences)]): each
# must make the unit tests fail, naming that alert only.
MUTATIONS = [
    ("WpubNoCommittedPublication", "attempts required",
     [("sum without (status) (increase(wpub_publications_total[15m])) > 0\nand\n", "", 1)]),
    ("WpubNoCommittedPublication", "15 minute window", [("[15m]", "[30m]", 2)]),
    ("WpubPublicationFailureRateHigh", "minimum count", [(">= 6", ">= 0", 1)]),
    ("WpubPublicationFailureRateHigh", "failed counted",
     [('status=~"aborted|failed"', 'status="aborted"', 1)]),
    ("WpubReceiverBehind", "left receivers excluded",
     [('\nunless ignoring (state)\n(wpub_receiver_state{state="left"} == 1)\n', "\n", 1)]),
    ("WpubReceiverBehind", "any lag", [("> 0", "> 5", 1)]),
    ("WpubHostSyncsRising", "minimum counts", [(">= 10", ">= 0", 2)]),
    ("WpubHostSyncsRising", "margins", [("> 1.2 *", "> 1.0 *", 1), (") >= 1\n", ") >= 0\n", 1)]),
    ("WpubDaemonDown", "wpubd jobs only", [('up{job=~"wpubd|.+/wpubd"}', "up", 1)]),
    ("WpubDaemonDown", "PodMonitor job", [('up{job=~"wpubd|.+/wpubd"}', 'up{job="wpubd"}', 1)]),
    ("WpubPublicationStuck", "in flight required",
     [("\nand\nwpub_publication_in_flight == 1", "", 1)]),
    ("WpubPublicationStuck", "threshold", [("> 600", "> 6000", 1)]),
]


def _rules(path=RULES):
    with open(path) as f:
        return yaml.safe_load(f)


def _alerts(doc):
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


class AlertRulesTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if not os.path.exists(PROMTOOL):
            raise unittest.SkipTest(f"{PROMTOOL} is missing (Debian package prometheus)")

    def promtool(self, *args, cwd=PROM):
        r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=300,
                           cwd=cwd)
        return r.returncode, r.stdout + r.stderr

    def test_check_rules(self):
        code, out = self.promtool("check", "rules", RULES)
        self.assertEqual(code, 0, out)
        n = sum(len(g["rules"]) for g in _rules()["groups"])
        self.assertIn(f"SUCCESS: {n} rules found", out)

    def test_unit_tests_pass(self):
        code, out = self.promtool("test", "rules", TESTS)
        self.assertEqual(code, 0, out)
        self.assertIn("SUCCESS", out)
        self.assertNotIn("FAILED", out)

    def test_conventions(self):
        alerts = _alerts(_rules())
        names = [a["alert"] for a in alerts]
        self.assertEqual(len(names), len(set(names)), names)
        for want in ("WpubNoCommittedPublication", "WpubPublicationFailureRateHigh",
                     "WpubReceiverBehind", "WpubHostSyncsRising", "WpubDaemonDown",
                     "WpubPublicationStuck"):
            self.assertIn(want, names)
        for a in alerts:
            with self.subTest(alert=a["alert"]):
                self.assertRegex(a["alert"], r"^Wpub[A-Z][A-Za-z]+$")
                self.assertRegex(a.get("for", ""), r"^[0-9]+[smh]$")
                self.assertIn(a["labels"]["severity"], ("critical", "warning"))
                self.assertEqual(set(a["annotations"]), {"summary", "description"})
                self.assertIn("$labels.instance", a["annotations"]["summary"])
                self.assertGreater(len(a["annotations"]["description"]), 100)

    def test_every_alert_has_firing_and_silent_cases(self):
        with open(TESTS) as f:
            tests = yaml.safe_load(f)
        self.assertEqual(tests["rule_files"], [os.path.basename(RULES)])
        names = {a["alert"] for a in _alerts(_rules())}
        firing, silent = set(), set()
        for t in tests["tests"]:
            for case in t["alert_rule_test"]:
                # A case naming no real alert would pass without testing anything.
                self.assertIn(case["alertname"], names, t.get("name"))
                (firing if case.get("exp_alerts") else silent).add(case["alertname"])
        self.assertEqual(firing, names, "alerts without a firing case")
        self.assertEqual(silent, names, "alerts without a silent case")

    def test_prometheus_rule_holds_the_same_groups(self):
        with open(PROMETHEUS_RULE) as f:
            rule = yaml.safe_load(f)
        self.assertEqual(rule["apiVersion"], "monitoring.coreos.com/v1")
        self.assertEqual(rule["kind"], "PrometheusRule")
        self.assertEqual(rule["spec"]["groups"], _rules()["groups"],
                         "deploy/k8s/base/prometheusrule.yaml and "
                         "deploy/prometheus/wpub-alerts.rules.yml differ")
        with open(os.path.join(DEPLOY, "k8s", "base", "kustomization.yaml")) as f:
            self.assertIn(os.path.basename(PROMETHEUS_RULE), yaml.safe_load(f)["resources"])

    def test_shipped_scrape_config_loads_the_rules(self):
        """prometheus.yml names the rules file (relative to itself, as the bundle's
        share/wpub/prometheus keeps them), and promtool checks both together."""
        with open(os.path.join(PROM, "prometheus.yml")) as f:
            config = yaml.safe_load(f)
        self.assertIn(os.path.basename(RULES), config["rule_files"])
        code, out = self.promtool("check", "config", "prometheus.yml")
        self.assertEqual(code, 0, out)
        self.assertIn("SUCCESS: 1 rule files found", out)

    def test_unit_tests_catch_broken_rules(self):
        d = tempfile.mkdtemp(prefix="wpub-alerts-")
        try:
            shutil.copy(TESTS, d)
            for alert, what, edits in MUTATIONS:
                with self.subTest(alert=alert, breaks=what):
                    doc = _rules()
                    (rule,) = [a for a in _alerts(doc) if a["alert"] == alert]
                    for old, new, count in edits:
                        self.assertEqual(rule["expr"].count(old), count,
                                         f"{alert}: {old!r} in its expr")
                        rule["expr"] = rule["expr"].replace(old, new)
                    with open(os.path.join(d, os.path.basename(RULES)), "w") as f:
                        yaml.safe_dump(doc, f, sort_keys=False)
                    code, out = self.promtool("check", "rules", os.path.basename(RULES), cwd=d)
                    self.assertEqual(code, 0, f"the mutation must stay valid PromQL: {out}")
                    code, out = self.promtool("test", "rules", os.path.basename(TESTS), cwd=d)
                    self.assertNotEqual(code, 0, f"{alert}: breaking '{what}' went unnoticed")
                    self.assertRegex(out, rf"alertname: {alert}, time: ", out)
                    # Only that alert's cases fail.
                    self.assertEqual(set(re.findall(r"alertname: (\w+), time: ", out)), {alert})
        finally:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()

"""The binaries' command lines as an operator types them: `--help` lists the command's own flags
(per subcommand for wpubctl) and exits 0 with no source paths; `--version` names the project
version and what the build was made against; a foreign flag, an unknown one, a stray positional
argument and a duration without a unit are errors that say so and exit 2; `--log_format=json`
writes one JSON object per line."""

import json
import os
import re
import shutil
import socket
import signal
import struct
import subprocess
import tempfile
import time
import unittest

WPUBD, WPUBCTL, RECV = os.environ["WPUBD"], os.environ["WPUBCTL"], os.environ["WPUB_RECV"]
VERSION = os.environ["WPUB_VERSION"]
SUBCOMMANDS = ["policy-report", "publish-synthetic", "status", "connect-engines", "demo",
               "convert", "inspect", "diff"]


def run(*args, timeout=30):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)


def flags_listed(text):
    return set(re.findall(r"^  --([a-z0-9_]+)", text, re.M))


class HelpAndVersion(unittest.TestCase):
    def check_help(self, r, must_have):
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("Usage:", r.stdout)
        for f in must_have:
            self.assertIn(f"--{f}", r.stdout)
        self.assertNotRegex(r.stdout, r"\.cc\b|/work/|No flags matched|undefined: a defect")
        return flags_listed(r.stdout)

    def test_each_binary_lists_its_own_flags(self):
        wpubd = self.check_help(run(WPUBD, "--help"), ["listen", "gpu_path", "log_format"])
        recv = self.check_help(run(RECV, "--help"), ["target", "engine_listen", "engine_protocol"])
        self.assertNotIn("bucket_bytes", recv)
        self.assertNotIn("engine_listen", wpubd)

    def test_wpubctl_lists_each_subcommands_flags_only(self):
        seen = {}
        for sub in SUBCOMMANDS:
            seen[sub] = self.check_help(run(WPUBCTL, sub, "--help"), [])
        self.assertIn("reports", seen["status"])
        self.assertIn("target", seen["status"])
        self.assertNotIn("model_dir", seen["status"])
        self.assertNotIn("target", seen["convert"])
        self.assertIn("model_dir", seen["convert"])
        self.assertIn("engines", seen["connect-engines"])
        self.assertLess(len(seen["status"]), 12)
        top = run(WPUBCTL, "help")
        self.assertEqual(top.returncode, 0)
        for sub in SUBCOMMANDS:
            self.assertIn(sub, top.stdout)

    def test_version(self):
        for argv in ([WPUBD, "--version"], [RECV, "--version"], [WPUBCTL, "--version"]):
            r = run(*argv)
            self.assertEqual(r.returncode, 0, r.stderr)
            name = os.path.basename(argv[0])
            self.assertRegex(r.stdout, rf"^{re.escape(name)} {re.escape(VERSION)} \(CUDA [^,]+, "
                                       r"NCCL [^,]+, gRPC 1\.\d+\.\d+, protobuf \d+\.\d+\.\d+")
        # A subcommand's own --version flag is the subcommand's (publish-synthetic's version
        # number), not the build's.
        r = run(WPUBCTL, "publish-synthetic", "--version=3", "--target=127.0.0.1:1",
                "--connect_timeout=100ms")
        self.assertNotIn(VERSION + " (CUDA", r.stdout)
        self.assertIn("cannot connect", r.stdout + r.stderr)


class Refusals(unittest.TestCase):
    def refused(self, argv, want):
        r = run(*argv)
        self.assertEqual(r.returncode, 2, f"{argv}: {r.stdout}{r.stderr}")
        self.assertIn(want, r.stderr)
        self.assertIn("--help` lists its flags", r.stderr)

    def test_foreign_and_unknown_flags(self):
        self.refused([WPUBCTL, "status", "--model_dir=/x"],
                     "--model_dir is not a flag of this command")
        self.refused([WPUBCTL, "convert", "--target=h:1"], "--target is not a flag of this command")
        self.refused([WPUBD, "--no_such=1"], "--no_such is not a flag")
        self.refused([RECV, "--gpu_path"], "--gpu_path is not a flag")

    def test_positional_arguments(self):
        self.refused([WPUBD, "serve"], "unexpected argument 'serve'")
        self.refused([WPUBCTL, "status", "now"], "unexpected argument 'now'")
        self.refused([RECV, "127.0.0.1:50151"], "unexpected argument '127.0.0.1:50151'")

    def test_missing_positional_arguments(self):
        self.refused([WPUBCTL, "inspect"], "expects PATH")
        self.refused([WPUBCTL, "diff", "a.safetensors"], "expects A B")
        self.refused([WPUBCTL, "inspect", "a", "b"], "unexpected argument 'b'")

    def test_a_duration_without_a_unit_gets_a_hint(self):
        self.refused([WPUBD, "--drain_deadline=60"], "a duration needs a unit")
        self.refused([RECV, "--connect_timeout", "10"], "a duration needs a unit")

    def test_engine_patches_only_where_they_can_be_kept(self):
        # Refused before any GPU is touched (or, in a build without CUDA, the engine mode is).
        for extra, want in ((["--engine_protocol=vllm"], "is for --engine_protocol=sglang"),
                            (["--output=/tmp/wpub_x.safetensors"], "no --output")):
            r = run(RECV, "--engine_listen=127.0.0.1:0", "--engine_patches", *extra)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertTrue(want in r.stderr or "needs a build with CUDA and NCCL" in r.stderr,
                            r.stderr)

    def test_a_bad_log_format(self):
        r = run(WPUBD, "--log_format=xml", "--listen=127.0.0.1:0", "--metrics_listen=")
        self.assertEqual(r.returncode, 2)
        self.assertIn("not text or json", r.stderr)


class JsonLogs(unittest.TestCase):
    def test_every_line_is_one_json_object(self):
        with tempfile.TemporaryDirectory() as d:
            ready = os.path.join(d, "ready.json")
            p = subprocess.Popen([WPUBD, "--log_format=json", "--log_level=debug",
                                  "--listen=127.0.0.1:0", "--metrics_listen=",
                                  f"--ready_file={ready}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 20
            while not os.path.exists(ready) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            self.assertTrue(os.path.exists(ready), p.stderr.read() if p.poll() else "not ready")
            p.send_signal(signal.SIGTERM)
            out, err = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, err)
        self.assertEqual(err, "")
        lines = [line for line in out.splitlines() if line.strip()]
        self.assertGreater(len(lines), 1)
        for line in lines:
            j = json.loads(line)
            self.assertEqual(j["logger"], "wpubd")
            self.assertIn(j["level"], ("trace", "debug", "info", "warning", "error", "critical"))
            self.assertRegex(j["ts"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00$")
            self.assertIsInstance(j["msg"], str)
        self.assertTrue(any("stopped" in json.loads(x)["msg"] for x in lines), out)



def write_safetensors(path, tensors, metadata=None):
    """A safetensors file written from the format's definition: {name: (dtype, shape, bytes)}."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


class InspectAndDiff(unittest.TestCase):
    """`wpubctl inspect` and `diff` on receivers' files: reports, JSON, exit codes."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="wpub-inspect-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        m = "model.layers.1.mlp.experts.0.down_proj"
        self.tensors = {
            f"{m}.weight": ("U8", [2, 16], bytes([0x22]) * 32),
            f"{m}.weight_scale": ("F8_E4M3", [2, 2], bytes([0x40]) * 4),  # 2.0
            f"{m}.weight_scale_2": ("F32", [], struct.pack("<f", 0.25)),
            "model.norm.weight": ("F32", [4], struct.pack("<4f", 1, 2, 3, 4)),
        }
        self.a = os.path.join(self.dir, "v1.safetensors")
        write_safetensors(self.a, self.tensors, {"version": "1", "format": "pt"})

    def test_inspect_text_and_json(self):
        r = run(WPUBCTL, "inspect", self.a, "--tensors", "--cpu_threads=2")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("1 NVFP4 (0 with input_scale)", r.stdout)
        self.assertIn("version = 1", r.stdout)
        self.assertIn("problems: none", r.stdout)
        self.assertRegex(r.stdout, r"model\.norm\.weight +F32 +\[4\] +16 +0x[0-9a-f]{16} "
                                   r"+high_precision +not_routed_expert")
        r = run(WPUBCTL, "inspect", self.a, "--output_format=json")
        self.assertEqual(r.returncode, 0, r.stderr)
        j = json.loads(r.stdout)
        self.assertEqual(j["kind"], "file")
        self.assertEqual(len(j["tensors"]), 4)
        self.assertEqual(j["nvfp4_modules"][0]["logical_shape"], [2, 32])
        self.assertEqual(j["by_role"]["nvfp4_weight"], {"tensors": 1, "bytes": 32})

    def test_inspect_is_safe_on_hostile_names_and_files(self):
        # A tensor name holding a terminal escape and a newline: the text report shows them
        # escaped (nothing reaches the terminal raw, no line is forged); JSON keeps them exact.
        hostile = dict(self.tensors)
        name = "model.x\x1b[2J\x1b]0;owned\x07\nproblems: none.weight"
        hostile[name] = ("F32", [1], struct.pack("<f", 1.0))
        path = os.path.join(self.dir, "hostile.safetensors")
        write_safetensors(path, hostile)
        r = run(WPUBCTL, "inspect", path, "--tensors")
        self.assertNotIn("\x1b", r.stdout)
        self.assertNotIn("\x07", r.stdout)
        self.assertIn("model.x\\x1b[2J", r.stdout)
        self.assertNotIn("\nproblems: none.weight", r.stdout)
        j = json.loads(run(WPUBCTL, "inspect", path, "--output_format=json").stdout)
        self.assertIn(name, [t["name"] for t in j["tensors"]])
        # A FIFO is refused at once (opening it for reading would wait for a writer forever).
        fifo = os.path.join(self.dir, "fifo.safetensors")
        os.mkfifo(fifo)
        r = run(WPUBCTL, "inspect", fifo, timeout=20)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("not a regular file (a FIFO)", r.stderr)

    def test_a_file_truncated_while_it_is_read_is_an_error_not_a_signal(self):
        # The file is mapped: truncating it under wpubctl makes an access fault (SIGBUS). Timing
        # decides whether a run sees the full file, the truncated one, or faults; none may die
        # by a signal.
        big = {"model.layers.0.mlp.down_proj.weight": ("BF16", [4096, 4096], bytes(32 << 20))}
        for attempt in range(3):
            path = os.path.join(self.dir, f"shrinking-{attempt}.safetensors")
            write_safetensors(path, big)
            p = subprocess.Popen([WPUBCTL, "inspect", path], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            time.sleep(0.005 * attempt)
            os.truncate(path, 1 << 20)
            out, err = p.communicate(timeout=60)
            self.assertGreaterEqual(p.returncode, 0, f"killed by signal {-p.returncode}: {err}")
            if "SIGBUS" in err:
                self.assertEqual(p.returncode, 1, err)
        # The fault itself, made certain: the message and exit status 1.
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # accepts, never answers: wpubctl waits
        p = subprocess.Popen([WPUBCTL, "status", f"--target=127.0.0.1:{silent.getsockname()[1]}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.3)
        p.send_signal(signal.SIGBUS)
        _, err = p.communicate(timeout=30)
        silent.close()
        self.assertEqual(p.returncode, 1, err)
        self.assertIn("truncated or replaced by another process while it was read", err)

    def test_inspect_exits_1_on_a_problem_and_2_on_unreadable_input(self):
        broken = dict(self.tensors)
        del broken["model.layers.1.mlp.experts.0.down_proj.weight_scale_2"]
        path = os.path.join(self.dir, "broken.safetensors")
        write_safetensors(path, broken)
        r = run(WPUBCTL, "inspect", path)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("down_proj.weight_scale_2: missing", r.stdout)
        with open(path, "r+b") as f:
            f.truncate(40)
        r = run(WPUBCTL, "inspect", path)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
        self.assertIn("broken.safetensors", r.stderr)
        r = run(WPUBCTL, "inspect", os.path.join(self.dir, "absent"))
        self.assertEqual(r.returncode, 2)
        self.assertIn("absent", r.stderr)
        r = run(WPUBCTL, "inspect", self.a, "--output_format=xml")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--output_format must be text or json", r.stderr)

    def test_diff(self):
        r = run(WPUBCTL, "diff", self.a, self.a)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("identical tensors", r.stdout)
        changed = dict(self.tensors)
        changed["model.norm.weight"] = ("F32", [4], struct.pack("<4f", 1, 2, 3.5, 4))
        b = os.path.join(self.dir, "v2.safetensors")
        write_safetensors(b, changed, {"version": "2", "format": "pt"})
        r = run(WPUBCTL, "diff", self.a, b)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("model.norm.weight: 1 of 4 elements differ, max |a-b| 0.5", r.stdout)
        self.assertIn("metadata.version: 1 -> 2", r.stdout)
        r = run(WPUBCTL, "diff", self.a, b, "--output_format=json")
        self.assertEqual(r.returncode, 1)
        j = json.loads(r.stdout)
        self.assertFalse(j["identical"])
        self.assertEqual(j["counts"], {"identical": 3, "changed_bytes": 1})
        self.assertEqual(j["tensors"][0]["differing_elements"], 1)


if __name__ == "__main__":
    unittest.main()

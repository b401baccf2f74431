"""wpubd's listener security, end to end against real processes: a non-loopback bind needs
TLS or --insecure_listen; TLS with a CA and certificates made here by openssl (the client
verifies the server; with --tls_client_ca_file a client without a certificate is refused);
wpubctl, wpub-recv and the Python client connect over TLS and mutual TLS;
a missing or wrong bearer token gets UNAUTHENTICATED and changes nothing; a Unix-socket
listener serves the Python client; the metrics port serves metrics only; message sizes and
streams per connection are bounded."""

import os
import shutil
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import grpc

from deploy_util import Daemon, binary, tiny_batches
import wpub  # noqa: E402 (deploy_util puts clients/python on sys.path)
from wpub._proto import pb  # noqa: E402

HEALTH = "/grpc.health.v1.Health/Check"
GET_STATUS = "/wpub.v1.Publisher/GetStatus"
SERVING = b"\x08\x01"  # HealthCheckResponse{status: SERVING}


def health(channel, timeout=5.0, metadata=None) -> bytes:
    call = channel.unary_unary(HEALTH, request_serializer=None, response_deserializer=None)
    return call(b"", timeout=timeout, metadata=metadata)


def get_status(channel, timeout=5.0, metadata=None):
    call = channel.unary_unary(GET_STATUS, request_serializer=pb.GetStatusRequest.SerializeToString,
                               response_deserializer=pb.GetStatusResponse.FromString)
    return call(pb.GetStatusRequest(), timeout=timeout, metadata=metadata)


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_pki(d: str):
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, both signed
    by the CA, and an unrelated CA."""
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                "-subj", f"/CN=wpub test {ca}", "-keyout", f"{d}/{ca}.key", "-out", f"{d}/{ca}.crt")
    with open(f"{d}/server.ext", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    with open(f"{d}/client.ext", "w") as f:
        f.write("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=wpub-{who}",
                "-keyout", f"{d}/{who}.key", "-out", f"{d}/{who}.csr")
        openssl("x509", "-req", "-in", f"{d}/{who}.csr", "-CA", f"{d}/ca.crt", "-CAkey",
                f"{d}/ca.key", "-CAcreateserial", "-days", "2", "-extfile", f"{d}/{who}.ext",
                "-out", f"{d}/{who}.crt")


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class SecurityTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="wpub-sec-")
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            self.assertEqual(d.stop(), 0, d.log())
        shutil.rmtree(self.dir, ignore_errors=True)

    def daemon(self, *flags, **kw) -> Daemon:
        d = Daemon(self.dir, *flags, **kw)
        self.daemons.append(d)
        return d

    def refused(self, *flags) -> str:
        r = subprocess.run([binary("WPUBD"), *flags], capture_output=True, text=True, timeout=30)
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        return r.stdout + r.stderr

    def test_non_loopback_needs_tls_or_acknowledgement(self):
        out = self.refused("--listen=0.0.0.0:0", "--metrics_listen=")
        self.assertIn("refusing to listen on non-loopback address '0.0.0.0:0' without TLS", out)
        self.assertIn("--tls_cert_file", out)
        self.assertIn("--insecure_listen", out)
        out = self.refused("--listen=127.0.0.1:0", "--metrics_listen=0.0.0.0:0")
        self.assertIn("--metrics_listen '0.0.0.0:0' is not loopback", out)
        # A certificate without its key is a configuration error, not a silent plaintext.
        make_pki(self.dir)
        out = self.refused("--listen=0.0.0.0:0", "--metrics_listen=",
                           f"--tls_cert_file={self.dir}/server.crt")
        self.assertIn("--tls_key_file", out)
        # The acknowledgement starts it, and says so loudly.
        d = self.daemon("--insecure_listen", listen="0.0.0.0:0")
        self.assertEqual(health(grpc.insecure_channel(f"127.0.0.1:{d.port}")), SERVING)
        self.assertIn("INSECURE", d.log())

    def test_tls_end_to_end(self):
        make_pki(self.dir)
        d = self.daemon(f"--tls_cert_file={self.dir}/server.crt",
                        f"--tls_key_file={self.dir}/server.key", listen="0.0.0.0:0")
        self.assertNotIn("INSECURE", d.log())
        target = f"127.0.0.1:{d.port}"
        creds = grpc.ssl_channel_credentials(root_certificates=read(f"{self.dir}/ca.crt"))
        with grpc.secure_channel(target, creds) as ch:
            self.assertEqual(health(ch), SERVING)
            self.assertTrue(get_status(ch).serving)
        # A client that does not trust the server's CA, or speaks plaintext, gets nowhere.
        rogue = grpc.ssl_channel_credentials(root_certificates=read(f"{self.dir}/rogue-ca.crt"))
        for ch in (grpc.secure_channel(target, rogue), grpc.insecure_channel(target)):
            with ch, self.assertRaises(grpc.RpcError) as cm:
                health(ch, timeout=3)
            self.assertIn(cm.exception.code(),
                          (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))

    def test_mutual_tls(self):
        make_pki(self.dir)
        d = self.daemon(f"--tls_cert_file={self.dir}/server.crt",
                        f"--tls_key_file={self.dir}/server.key",
                        f"--tls_client_ca_file={self.dir}/ca.crt", listen="0.0.0.0:0")
        target = f"127.0.0.1:{d.port}"
        ca = read(f"{self.dir}/ca.crt")
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=read(f"{self.dir}/client.key"),
            certificate_chain=read(f"{self.dir}/client.crt"))
        with grpc.secure_channel(target, with_cert) as ch:
            self.assertEqual(health(ch), SERVING)
            self.assertEqual(get_status(ch).committed_version, 0)
        # No client certificate, or one the server's client CA did not sign: refused.
        rogue_pair = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=read(f"{self.dir}/rogue-ca.key"),
            certificate_chain=read(f"{self.dir}/rogue-ca.crt"))
        for creds in (grpc.ssl_channel_credentials(root_certificates=ca), rogue_pair):
            with grpc.secure_channel(target, creds) as ch, \
                    self.assertRaises(grpc.RpcError) as cm:
                health(ch, timeout=3)
            self.assertIn(cm.exception.code(),
                          (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))

    def tool(self, name: str, *args, ok: bool = True) -> str:
        r = subprocess.run([binary(name), *args], capture_output=True, text=True, timeout=60)
        out = r.stdout + r.stderr
        if ok:
            self.assertEqual(r.returncode, 0, out)
        else:
            self.assertNotEqual(r.returncode, 0, out)
        return out

    def test_tools_and_python_client_over_tls(self):
        """wpubctl, wpub-recv and wpub.Publisher speak TLS (and mutual TLS) to the daemon: a
        publication reaches the receiver; a client without the daemon's CA gets nowhere."""
        make_pki(self.dir)
        d = self.daemon(f"--tls_cert_file={self.dir}/server.crt",
                        f"--tls_key_file={self.dir}/server.key",
                        f"--tls_client_ca_file={self.dir}/ca.crt", listen="0.0.0.0:0")
        target = f"127.0.0.1:{d.port}"
        tls = [f"--tls_ca_file={self.dir}/ca.crt", f"--tls_cert_file={self.dir}/client.crt",
               f"--tls_key_file={self.dir}/client.key"]
        out = self.tool("WPUBCTL", "status", f"--target={target}", *tls)
        self.assertIn("serving", out)
        # Plaintext, the wrong CA, or no client certificate: refused.
        self.tool("WPUBCTL", "status", f"--target={target}", "--connect_timeout=2s", ok=False)
        self.tool("WPUBCTL", "status", f"--target={target}", "--connect_timeout=2s",
                  f"--tls_ca_file={self.dir}/rogue-ca.crt", ok=False)
        # A certificate without its key, or an unreadable CA, is a clear error.
        out = self.tool("WPUBCTL", "status", f"--target={target}",
                        f"--tls_ca_file={self.dir}/ca.crt",
                        f"--tls_cert_file={self.dir}/client.crt", ok=False)
        self.assertIn("certificate and key go together", out)
        out = self.tool("WPUBCTL", "status", f"--target={target}",
                        f"--tls_ca_file={self.dir}/missing.crt", ok=False)
        self.assertIn("missing.crt", out)

        output = os.path.join(self.dir, "recv.safetensors")
        recv = subprocess.Popen([binary("WPUB_RECV"), f"--target={target}", "--name=tls-recv",
                                 f"--output={output}", "--exit_after_versions=1", *tls],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            pub = wpub.Publisher(target, tls_ca_file=f"{self.dir}/ca.crt",
                                 tls_cert_file=f"{self.dir}/client.crt",
                                 tls_key_file=f"{self.dir}/client.key")
            try:
                deadline = time.monotonic() + 20
                while not pub.status().receivers and time.monotonic() < deadline:
                    time.sleep(0.05)
                report = pub.publish(1, tiny_batches(seed=3))
                self.assertTrue(report.committed, report.summary())
            finally:
                pub.close()
            self.assertEqual(recv.wait(timeout=30), 0, recv.stdout.read())
        finally:
            if recv.poll() is None:
                recv.kill()
        with open(output, "rb") as f:
            self.assertGreater(len(f.read()), 0)
        # The Python client refuses half a client identity before connecting.
        with self.assertRaises(ValueError) as cm:
            wpub.Publisher(target, tls_ca_file=f"{self.dir}/ca.crt",
                           tls_cert_file=f"{self.dir}/client.crt")
        self.assertIn("tls_key_file", str(cm.exception))

    def test_bearer_token(self):
        token = os.path.join(self.dir, "token")
        with open(token, "w") as f:
            f.write("correct-horse\n")
        wrong = os.path.join(self.dir, "wrong")
        with open(wrong, "w") as f:
            f.write("battery-staple\n")
        d = self.daemon(f"--auth_token_file={token}")
        for t in (None, "battery-staple", "Bearer correct-horse"):
            pub = wpub.Publisher(d.target, token=t)
            with self.assertRaises(wpub.Unauthenticated):
                pub.status()
            with self.assertRaises(wpub.Unauthenticated):
                pub.publish(1, tiny_batches())
            with self.assertRaises(wpub.Unauthenticated):
                pub.list_reports()
            pub.close()
        r = subprocess.run([binary("WPUBCTL"), "publish-synthetic", f"--target={d.target}",
                            f"--auth_token_file={wrong}", "--model_style=qwen3_moe",
                            "--num_layers=1", "--num_experts=2", "--hidden_size=256",
                            "--moe_intermediate_size=128", "--intermediate_size=512",
                            "--vocab_size=1024", "--version=5"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("UNAUTHENTICATED", r.stdout + r.stderr)
        # Nothing changed: no publication ran, nothing was committed.
        ok = wpub.Publisher(d.target, token="correct-horse")
        status = ok.status(max_reports=8)
        self.assertEqual(status.committed_version, 0)
        self.assertIsNone(status.active)
        self.assertEqual(ok.list_reports(), [])
        # Health stays open to probes (it reveals only SERVING), and the right token works.
        self.assertEqual(health(grpc.insecure_channel(d.target)), SERVING)
        self.assertEqual(ok.publish(1, tiny_batches()).status, "COMMITTED")
        self.assertEqual(ok.status().committed_version, 1)
        ok.close()
        # The token never came from the command line: a token flag does not exist.
        out = self.refused("--auth_token=correct-horse", "--metrics_listen=")
        self.assertIn("auth_token", out)

    def test_unix_socket_with_python_client(self):
        sock = os.path.join(self.dir, "wpubd.sock")
        d = self.daemon(listen=f"unix:{sock}")
        self.assertEqual(d.port, 0)
        self.assertTrue(os.path.exists(sock))
        pub = wpub.Publisher(f"unix://{sock}")
        pub.wait_ready(10)
        report = pub.publish(1, tiny_batches())
        self.assertEqual(report.status, "COMMITTED")
        self.assertGreater(report.tensors_quantized, 0)
        self.assertEqual(pub.status().committed_version, 1)
        pub.close()
        with grpc.insecure_channel(f"unix://{sock}") as ch:
            self.assertEqual(health(ch), SERVING)

    def test_metrics_port_serves_metrics_only(self):
        d = self.daemon(metrics="127.0.0.1:0")
        base = f"http://127.0.0.1:{d.metrics_port}"
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            body = r.read().decode()
        self.assertIn("wpub_publications_total", body)
        for path in ("/", "/debug/pprof", "/wpub.v1.Publisher/GetStatus", "/metrics/../etc"):
            with self.assertRaises(urllib.error.HTTPError, msg=path) as cm:
                urllib.request.urlopen(base + path, timeout=5)
            self.assertEqual(cm.exception.code, 404, path)
        with grpc.insecure_channel(f"127.0.0.1:{d.metrics_port}") as ch, \
                self.assertRaises(grpc.RpcError):
            health(ch, timeout=3)

    def test_message_size_and_stream_bounds(self):
        d = self.daemon("--max_message_bytes=2097152", "--max_chunk_bytes=1048576",
                        "--max_concurrent_streams=2")
        # A request larger than --max_message_bytes is refused before it is parsed
        # (unknown field 15, length-delimited, 3 MiB).
        big = 3 << 20
        blob = bytearray(b"\x7a")
        n = big
        while True:
            blob.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                break
        blob += b"\0" * big
        with grpc.insecure_channel(d.target, options=[
                ("grpc.max_send_message_length", 8 << 20)]) as ch:
            call = ch.unary_unary(GET_STATUS, request_serializer=None,
                                  response_deserializer=None)
            with self.assertRaises(grpc.RpcError) as cm:
                call(bytes(blob), timeout=10)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertEqual(health(ch), SERVING)
        # Two Publish streams held open on one connection use up its streams: a third call on
        # that connection waits, while another connection is served.
        release = threading.Event()
        # A local subchannel pool: Python channels with equal arguments otherwise share one
        # connection.
        local = [("grpc.use_local_subchannel_pool", 1)]
        ch = grpc.insecure_channel(d.target, options=local)
        publish = ch.stream_unary("/wpub.v1.Publisher/Publish", request_serializer=None,
                                  response_deserializer=None)

        def blocking_requests():
            release.wait(30)
            return
            yield

        futures = [publish.future(blocking_requests(), timeout=30) for _ in range(2)]
        try:
            time.sleep(0.5)
            with self.assertRaises(grpc.RpcError) as cm:
                health(ch, timeout=1.5)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
            with grpc.insecure_channel(d.target, options=local) as other:
                self.assertEqual(health(other), SERVING)
        finally:
            release.set()
            for f in futures:
                try:
                    f.result(timeout=30)
                except grpc.RpcError:
                    pass
            ch.close()


if __name__ == "__main__":
    unittest.main()

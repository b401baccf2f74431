"""One publisher's publication as the pipeline wpub runs (core/gpu/README.md, "One publication").

Stages, in the order the code runs them:
  host setup (per input) -> [amax + non-finite pass over every input, then the host's check]
  -> per bucket k: compute stream: quantize/pack/copies (+ amax when pipelined) into staging
     buffer k%2, which it reuses only after broadcast k-2 is done; `ready` before the checksum
  -> the host sends bucket k's update request on one of `lanes` connections (a lane frees when
     an earlier request is answered), then enqueues broadcast k on the comm stream
  -> the engine decodes the request, posts its receive (behind the previous one when its
     receive is two-deep), receives, verifies (checksum) and answers
  -> the host's final wait, the last acknowledgement, then the lifecycle calls (commit).
A broadcast runs when its bucket is ready, the engine has posted its receive and the previous
broadcast is done. Times are in seconds; the recurrence runs bucket by bucket.
"""

from dataclasses import dataclass, field


@dataclass
class Link:
    """How a bucket crosses to the engines: a rate and a start latency per bucket."""
    bytes_per_s: float
    latency_s: float = 0.0
    beside_slowdown: float = 1.0  # the broadcast slows while the next bucket is computed


@dataclass
class Stages:
    """Where a publication's time goes (seconds on the critical path, summed to the wall)."""
    setup: float = 0.0
    amax_check: float = 0.0
    first_bucket: float = 0.0
    transfer: float = 0.0
    stalls: float = 0.0      # time between broadcasts (compute, engine or lanes set the pace)
    tail: float = 0.0        # the engine's last verify and answer after the last broadcast
    commit: float = 0.0
    wall: float = 0.0
    buckets: int = 0
    busy_compute: float = 0.0
    busy_engine_decode: float = 0.0
    extra: dict = field(default_factory=dict)


def _compute_s(p, b, pipelined, quantize_Bps):
    """Device time of one bucket's compute, alone. Returns (until ready, whole)."""
    t = b.in_bytes_quantized / quantize_Bps + b.in_bytes_passed / p["copy_passed_Bps"]
    if pipelined:
        t += b.in_bytes_quantized / p["amax_Bps"] + b.in_bytes_passed / p["scan_passed_Bps"]
    return t, t + b.out_bytes / p["checksum_Bps"]


def publish(p, buckets, link, *, check_first=True, lanes=None, inputs=0, engine=True,
            quantize_Bps=None, hbm_scale=1.0, remote_fraction=0.0, peer_read_Bps=None,
            rtt_s=None):
    """Wall clock of one publication of `buckets` by one publisher.

    p: a profile of inputs.yaml (values only). link: the bucket transfer. check_first: the
    non-finite check before any byte is sent (mode a) or the amax pipelined (mode a').
    engine=False: the backend alone (no transfer; buckets dropped once packed). hbm_scale
    scales every HBM-bound rate (another GPU); remote_fraction of the input is read from peer
    GPUs at peer_read_Bps (a publisher reading its node's other GPUs).
    """
    lanes = lanes or int(p["requests_in_flight"])
    rtt = p["http_rtt_s"] if rtt_s is None else rtt_s
    qBps = (quantize_Bps or p["quantize_Bps"]) * hbm_scale
    q = dict(p)
    for k in ("amax_Bps", "scan_passed_Bps", "copy_passed_Bps", "checksum_Bps"):
        q[k] = p[k] * hbm_scale
    if remote_fraction > 0.0:
        # Reading a peer's memory is bounded by the link; blend per byte.
        def blend(r):
            return 1.0 / ((1.0 - remote_fraction) / r + remote_fraction / peer_read_Bps)
        for k in ("amax_Bps", "scan_passed_Bps", "copy_passed_Bps"):
            q[k] = blend(q[k])
        qBps = blend(qBps)
    s = Stages(buckets=len(buckets))
    s.setup = inputs * p["setup_per_input_s"]
    t = s.setup
    in_total = sum(b.in_bytes_quantized + b.in_bytes_passed for b in buckets)
    if check_first:
        amax = (sum(b.in_bytes_quantized for b in buckets) / q["amax_Bps"]
                + sum(b.in_bytes_passed for b in buckets) / q["scan_passed_Bps"])
        dev_free = t + amax                      # bucket 0 is packed right behind the pass
        host = dev_free + p["check_read_s"]      # the host reads the counts, then sends
        s.amax_check = host - t
    else:
        dev_free = host = t
    s.extra["input_bytes"] = in_total
    n = len(buckets)
    c_end, x_start, x_end, v_end, ans = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    depth = int(p["engine_receive_depth"])
    slow_c = p["compute_beside_slowdown"] if engine else 1.0
    h_prev = host
    dec_prev = 0.0
    for k, b in enumerate(buckets):
        ready_s, whole_s = _compute_s(q, b, not check_first, qBps)
        if k > 0:
            ready_s, whole_s = ready_s * slow_c, whole_s * slow_c
        start = max(dev_free, c_end[k - 1] if k else 0.0, x_end[k - 2] if k >= 2 else 0.0)
        if engine and k == 1:
            start = max(start, x_start[0])       # bucket 1 goes in after the first broadcast
        if engine and k >= 1:
            start = max(start, h_prev)           # launched by the host after bucket k-1's hand-over
        ready = start + ready_s
        c_end[k] = start + whole_s
        s.busy_compute += whole_s
        if not engine:
            continue
        # The host: a free lane, then the request, then the broadcast is enqueued.
        h = max(h_prev, ans[k - lanes] if k >= lanes else 0.0) + p["host_per_bucket_s"]
        h_prev = h
        h += b.entries * p["driver_encode_per_entry_s"]  # the lane encodes, then sends
        decode = b.entries * p["engine_decode_per_entry_s"]
        s.busy_engine_decode += decode
        arrived = h + rtt / 2
        if p.get("engine_decode_serial"):
            arrived = max(arrived, dec_prev)
        dec_prev = arrived + decode
        posted = dec_prev
        if depth <= 1 and k >= 1:
            posted = max(posted, v_end[k - 1])
        elif k >= 2:
            posted = max(posted, v_end[k - 2])
        x_start[k] = max(ready, posted, x_end[k - 1] if k else 0.0, h)
        rate = link.bytes_per_s / (link.beside_slowdown if k < n - 1 else 1.0)
        x_end[k] = x_start[k] + link.latency_s + b.out_bytes / rate
        s.transfer += link.latency_s + b.out_bytes / rate
        v_end[k] = x_end[k] + p["engine_verify_fixed_s"] + b.out_bytes / p["engine_checksum_Bps"]
        ans[k] = v_end[k] + rtt / 2
    if not engine:
        s.first_bucket = 0.0
        s.wall = c_end[-1] + p["check_read_s"]
        s.stalls = s.wall - s.setup - s.amax_check
        return s
    s.first_bucket = x_start[0] - s.setup - s.amax_check
    execute_end = max(x_end[-1], c_end[-1]) + p["check_read_s"]
    acked = max(execute_end, ans[-1] + rtt / 2)
    s.stalls = x_end[-1] - x_start[0] - s.transfer
    s.tail = acked - x_end[-1]
    # Three lifecycle calls; a farther engine adds its extra round trip to each.
    s.commit = p["commit_s"] + 3 * max(0.0, rtt - p["http_rtt_s"])
    s.wall = acked + s.commit
    return s


def broadcast_only(buckets, link):
    """(d): a plain broadcast of the same bucket bytes, back to back."""
    return sum(link.latency_s + b.out_bytes / link.bytes_per_s for b in buckets)

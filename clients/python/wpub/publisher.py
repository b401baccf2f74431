"""wpub.Publisher: streams one publication at a time to wpubd and returns its report.

Threading model: the trainer's iterable of conversion batches is consumed in the CALLING thread
(so its CUDA device, exceptions and KeyboardInterrupt behave as in the rest of the training
loop); serialized messages go through a small bounded queue to gRPC's sending thread, so a slow
daemon blocks the trainer through gRPC flow control instead of buffering the model in memory.
"""

import logging
import os
import sys
import threading
import time
import weakref
from typing import (Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc

from . import errors
from ._proto import pb
from .group import group_preamble
from ._options import (DEFAULT_TARGET, build_header, check_target, check_version,
                       engine_entries, queue_flag, read_token_file, tls_credentials)
from .futures import PublicationFuture
from .progress import Progress
from ._request_stream import _POLL_S, _CallEnded, _RequestStream
from .report import ClientTimings, EngineGroup, PublicationReport, ReplayReport, Status
from .shm import ShmArena, ShmPool, ShmSegment, align
from .tensors import CudaPart, HostPart, ShmPart, TensorError, normalize

_log = logging.getLogger(__name__)

_SERVICE = "/wpub.v1.Publisher/"
_PUBLISHER_TIMEOUT = object()  # publish(timeout=...) default: the Publisher's timeout
_STARTING = object()  # _active while publish_async's thread has not opened its RPC yet

# Publisher.from_env: environment variable -> constructor argument. WPUB_TARGET and
# WPUB_TOKEN_FILE are what the shipped Kubernetes manifests set (deploy/k8s).
ENV_VARS = {"WPUB_TARGET": "target", "WPUB_TOKEN_FILE": "token_file",
            "WPUB_TLS_CA_FILE": "tls_ca_file", "WPUB_TLS_CERT_FILE": "tls_cert_file",
            "WPUB_TLS_KEY_FILE": "tls_key_file"}

Batch = Tuple[str, Sequence[Tuple[str, Any]]]


def _sync_cuda(devices) -> None:
    """Waits for the current stream of every device whose tensors are about to be shared: the
    daemon reads them on its own streams and cannot see the trainer's pending work."""
    import torch
    for d in devices:
        torch.cuda.current_stream(d).synchronize()


class Publisher:
    """A connection to one wpubd. Thread-safety: one publish() at a time per Publisher (the
    daemon allows one publication at a time anyway); cancel(), status(), list_reports() and
    connect_engines() may be called from any thread while a publish() is in flight (the daemon
    refuses a connect_engines while a publication is open).

    target: "host:port" or "unix:/path" (checked: InvalidArgument naming what is wrong).
    token: bearer token when the daemon requires one; token_file: a file holding it (what
    Kubernetes mounts from a Secret), read once here; not both. Publisher.from_env() reads
    both from the environment.
    timeout: default deadline of publish() in seconds (None: no deadline).
    shm_threshold_bytes: host parts at least this large travel through POSIX shared memory,
    smaller ones inline in the stream (0: everything through shm; None: everything inline).
    chunk_bytes: inline chunk size (the daemon accepts up to 4 MiB by default).
    reuse_shm: keep each publication's shared-memory segments for the next one (same model
    every step: pages already faulted in are several times faster to fill); False unlinks them
    after every report.
    cuda_sync: synchronize each device's current stream before sharing its tensors.
    max_queued_messages: messages buffered ahead of gRPC (bounds client memory).
    tls_ca_file: PEM CA certificate the daemon's TLS certificate must chain to (wpubd
    --tls_cert_file); the channel is then TLS, else plaintext. tls_cert_file / tls_key_file: a
    client certificate and key, for a daemon that verifies clients (--tls_client_ca_file).
    credentials: any grpc.ChannelCredentials instead of the three files.
    """

    def __init__(self, target: str, token: Optional[str] = None,
                 timeout: Optional[float] = 600.0, *, token_file: Optional[str] = None,
                 rpc_timeout: float = 10.0,
                 shm_threshold_bytes: Optional[int] = 1 << 20, chunk_bytes: int = 1 << 20,
                 shm_prefix: str = "wpub", reuse_shm: bool = True, cuda_sync: bool = True,
                 max_queued_messages: int = 8, max_message_bytes: int = 8 << 20,
                 channel_options: Sequence[Tuple[str, Any]] = (),
                 tls_ca_file: Optional[str] = None, tls_cert_file: Optional[str] = None,
                 tls_key_file: Optional[str] = None,
                 credentials: Optional[grpc.ChannelCredentials] = None):
        if chunk_bytes <= 0 or chunk_bytes > max_message_bytes - 4096:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be in (0, max_message_bytes - 4096]")
        if "/" in shm_prefix:
            raise ValueError(f"shm_prefix '{shm_prefix}' must not contain '/'")
        check_target(target)
        if token is not None and token_file is not None:
            raise errors.InvalidArgument("give token or token_file, not both")
        if token_file is not None:
            token = read_token_file(token_file)
        if credentials is None:
            credentials = tls_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        self.target = target
        self.timeout = timeout
        self.rpc_timeout = rpc_timeout
        self.shm_threshold_bytes = shm_threshold_bytes
        self.chunk_bytes = chunk_bytes
        self.shm_prefix = shm_prefix
        self.reuse_shm = reuse_shm
        self._shm = ShmPool(shm_prefix)
        self._arena = ShmArena(shm_prefix)
        # Unlink kept segments when the Publisher is collected or the interpreter exits.
        self._shm_finalizer = weakref.finalize(self, ShmPool.close, self._shm)
        self._arena_finalizer = weakref.finalize(self, ShmArena.close, self._arena)
        self.cuda_sync = cuda_sync
        self.max_queued_messages = max(1, max_queued_messages)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", 64 << 20), *channel_options]
        self._channel = (grpc.secure_channel(target, credentials, options=options)
                         if credentials is not None
                         else grpc.insecure_channel(target, options=options))
        # Generic method handles: no generated _pb2_grpc code (see _proto.py).
        self._publish = self._channel.stream_unary(
            _SERVICE + "Publish", request_serializer=None,
            response_deserializer=pb.PublicationReport.FromString)
        self._get_status = self._channel.unary_unary(
            _SERVICE + "GetStatus", request_serializer=pb.GetStatusRequest.SerializeToString,
            response_deserializer=pb.GetStatusResponse.FromString)
        self._list_reports = self._channel.unary_unary(
            _SERVICE + "ListReports", request_serializer=pb.ListReportsRequest.SerializeToString,
            response_deserializer=pb.ListReportsResponse.FromString)
        self._connect_engines = self._channel.unary_unary(
            _SERVICE + "ConnectEngines",
            request_serializer=pb.ConnectEnginesRequest.SerializeToString,
            response_deserializer=pb.ConnectEnginesResponse.FromString)
        self._restore = self._channel.unary_unary(
            _SERVICE + "Restore", request_serializer=pb.RestoreRequest.SerializeToString,
            response_deserializer=pb.ReplayReport.FromString)
        self._lock = threading.Lock()
        self._active = None  # the Publish call in flight, or _STARTING (guarded by _lock)
        self._owner: Optional[PublicationFuture] = None  # publish_async's (guarded by _lock)
        self._cancel_requested = False

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **kwargs) -> "Publisher":
        """A Publisher configured from the environment (default: os.environ), as the shipped
        Kubernetes manifests set it: WPUB_TARGET (default 127.0.0.1:50151, wpubd's default
        listener), WPUB_TOKEN_FILE, and WPUB_TLS_CA_FILE / WPUB_TLS_CERT_FILE /
        WPUB_TLS_KEY_FILE. Empty variables count as unset; keyword arguments override them
        and pass every other constructor argument."""
        env = os.environ if environ is None else environ
        args: Dict[str, Any] = {}
        for var, arg in ENV_VARS.items():
            value = env.get(var, "")
            if value:
                args[arg] = value
        if "token" in kwargs:
            args.pop("token_file", None)  # an explicit token overrides the mounted file
        args.update(kwargs)
        args.setdefault("target", DEFAULT_TARGET)
        _log.debug("Publisher.from_env: target %s, token file %s", args["target"],
                   args.get("token_file"))
        return cls(**args)

    # -- lifecycle -----------------------------------------------------------------------------

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Blocks until the channel is connected; raises Unavailable after `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.Unavailable(
                f"cannot connect to wpubd at '{self.target}' within {timeout} s") from None

    def close(self) -> None:
        """Cancels a publish() in flight, unlinks the kept shared-memory segments and closes
        the channel."""
        self.cancel()
        self._shm_finalizer()
        self._arena_finalizer()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- unary calls ---------------------------------------------------------------------------

    def _unary(self, method, request, timeout):
        try:
            return method(request, timeout=self.rpc_timeout if timeout is None else timeout,
                          metadata=self._metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def status(self, max_reports: int = 0, timeout: Optional[float] = None) -> Status:
        """The daemon's state: committed version, active publication, receivers, and up to
        `max_reports` recent reports."""
        return Status.from_proto(
            self._unary(self._get_status, pb.GetStatusRequest(max_reports=max_reports), timeout))

    def list_reports(self, limit: int = 0, timeout: Optional[float] = None
                     ) -> List[PublicationReport]:
        """Recent publication reports, newest first (0: the daemon's default count)."""
        m = self._unary(self._list_reports, pb.ListReportsRequest(limit=limit), timeout)
        return [PublicationReport.from_proto(r) for r in m.reports]

    def connect_engines(self, engines: Iterable[Any], group_name: Optional[str] = None,
                        timeout: Optional[float] = None,
                        pause: Optional[str] = None) -> EngineGroup:
        """Connects SGLang or vLLM engines to a GPU-path wpubd (ConnectEngines): replaces its
        engine set and forms the NCCL weight-update group. Blocks until every engine joined.

        engines: in rank order, each "http://host:port" (1 GPU), "http://host:port=gpus" (as
        wpubd --engines takes them), ("http://host:port", gpus) or
        {"url": ..., "gpus": ..., "kind": "sglang" | "vllm"}; a "vllm+http://host:port" URL is a
        vLLM engine (its native weight-transfer API, v0.22 or later). One group holds one kind. group_name: base group name (default: the daemon's
        --nccl_group). timeout: seconds the engines have to answer their health probe and join
        (default: the daemon's --engine_deadline); the RPC waits 30 s longer. pause: what the
        engines do with their requests and cache while paused for a publication,
        "<in_flight>[:<cache>]" -- in_flight "abort" (no request's tokens from two versions),
        "wait" (vLLM), "retract" or "keep"; cache "flush" or "keep" (default: the daemon's
        --pause; docs/specs/engines.md, "Pause policies"). A policy the engines' kind cannot
        carry out raises InvalidArgument naming it.

        Returns an EngineGroup (group_name of this generation, world_size, generation, and per
        engine its rank_offset and gpus). Raises InvalidArgument naming the entry (here or from
        the daemon), FailedPrecondition on a daemon without the GPU path or while a publication
        is in flight (naming its version), Unavailable / DeadlineExceeded naming the engine that
        did not join. On failure the daemon has no engines connected (its previous group was
        torn down first) and publications reach no engine until a connect_engines succeeds.
        """
        req = pb.ConnectEnginesRequest(group_name=group_name or "")
        for url, gpus, kind in engine_entries(engines):
            req.engines.add(url=url, gpus=gpus, kind=kind)
        if timeout is not None:
            if not timeout > 0:
                raise errors.InvalidArgument(f"timeout={timeout!r} must be > 0 seconds")
            req.timeout_seconds = float(timeout)
        if pause is not None:
            if not isinstance(pause, str) or not pause:
                raise errors.InvalidArgument(f"pause={pause!r} must be a non-empty string")
            in_flight, _, cache = pause.partition(":")
            req.pause.in_flight = in_flight
            req.pause.cache = cache
        # The daemon's default join budget is its --engine_deadline (120 s by default).
        rpc_timeout = (timeout if timeout is not None else 120.0) + 30.0
        return EngineGroup.from_proto(self._unary(self._connect_engines, req, rpc_timeout))

    def restore(self, reason: str = "", timeout: Optional[float] = None) -> ReplayReport:
        """Replays the daemon's retained committed version (wpubd --retain) to every engine --
        the ones an aborted publication left dirty are restored, all are resumed on it -- and
        to every pull receiver that holds less (Restore). Blocks until the replay ends.

        Returns a ReplayReport (`completed`, or `preempted` / `error`). Raises
        FailedPrecondition naming why nothing is retained (--retain=off, over
        --retain_max_bytes, nothing committed since the daemon started), for a group version,
        or naming the publication in progress; DaemonShuttingDown once the daemon stops.
        timeout: seconds (default: the Publisher's rpc_timeout).
        """
        return ReplayReport.from_proto(
            self._unary(self._restore, pb.RestoreRequest(reason=reason), timeout))

    def shm_empty(self, shape, dtype) -> "np.ndarray":
        """A numpy array allocated in POSIX shared memory: publishing it (or a contiguous view
        of it, e.g. wrapped as wpub.Tensor(a, "bfloat16") for bf16 bits in uint16) sends a
        reference, with no copy. For trainers that keep host weights or convert into
        preallocated buffers: allocate once, refill every step. It must not change while a
        publish() using it is in flight; it lives until close()."""
        return self._arena.empty(shape, dtype)

    def cancel(self) -> None:
        """Cancels the publish() in flight, if any: the daemon aborts the publication, every
        receiver keeps the previous version, and publish() raises wpub.Cancelled."""
        with self._lock:
            self._cancel_requested = True
            call = self._active
        if call is not None and call is not _STARTING:  # a starting one sees the flag
            call.cancel()

    # -- publish -------------------------------------------------------------------------------

    def publish(self, version: int, batches: Iterable[Batch], *, recipe: str = "nvfp4",
                policy: Optional[Dict[str, Any]] = None,
                quantization_config: Union[None, str, Dict[str, Any]] = None,
                model_id: str = "", allow_non_finite: bool = False,
                queue_behind_active: bool = False, bucket_bytes: int = 0,
                timeout: Any = _PUBLISHER_TIMEOUT, check: bool = True,
                progress: Optional[Callable[[Progress], None]] = None,
                wait: Optional[bool] = None, group: Optional["GroupSpec"] = None,
                expected_tensors: Optional[Iterable[str]] = None,
                release_gpu_memory: bool = False) -> PublicationReport:
        """Streams one publication and returns the daemon's report.

        version: an int in [1, 2^64 - 1], strictly increasing (InvalidArgument otherwise,
        before anything is sent). batches: iterable of (megatron_name, [(hf_name, tensor),
        ...]); consumed lazily, each batch sent as soon as it is produced. A tensor is a numpy
        array, a torch CPU or CUDA tensor, wpub.Tensor(array, dtype=...), wpub.CudaIpc,
        wpub.ShmRef or wpub.concat(parts, dim).
        recipe: "nvfp4", "nvfp4_4over6:<mode>" or "bf16". policy: precision exceptions (keys of
        wpub.v1.PrecisionExceptions, e.g. {"first_last_layers_bf16": True, "num_layers": 48},
        and "allow_nothing_quantized": True to publish a quantizing recipe whose plan
        quantizes no tensor, which is otherwise an InvalidArgument naming the recipe and some
        tensors). quantization_config: the HF quantization_config (dict or JSON).
        queue_behind_active: when another publication is active on the daemon, wait for it to
        end instead of failing with FailedPrecondition (`wait=` is the deprecated name).
        timeout: deadline in seconds (default: the Publisher's). check: raise
        PublicationAborted when the publication did not commit. progress: called with a
        wpub.Progress after each batch ("send"), once everything is sent ("commit") and at the
        end ("done" / "failed"); it runs in the publishing thread, and an exception it raises
        while sending cancels the publication like one of the iterable.

        Raises the WpubError subclass of the daemon's status (its message names the tensor), or
        re-raises an exception of the iterable (KeyboardInterrupt included) after cancelling the
        RPC, which aborts the publication on the daemon. Host payloads are copied (into shared
        memory or messages) before publish returns from a batch; CUDA tensors are referenced
        and kept alive until the report arrived.

        group: a wpub.GroupSpec when this publication is one member's part of a group version
        (several daemons, one version; wpub.PublicationGroup wraps it). expected_tensors: the
        leader's (member 0's) declaration of every tensor name the group publishes.
        release_gpu_memory: the daemon frees its GPU staging buffers once this publication
        ended, committed or not (as wpubd --release_gpu_memory does after every one), for a
        colocated engine that uses the GPU until the next publication.
        """
        version = check_version(version)
        header = build_header(version, recipe, policy, quantization_config, model_id,
                         allow_non_finite, queue_flag(queue_behind_active, wait), bucket_bytes,
                         release_gpu_memory)
        preamble = group_preamble(header, group, expected_tensors)
        return self._run(header, batches, self.timeout if timeout is _PUBLISHER_TIMEOUT
                         else timeout, check, progress, None, preamble)

    def publish_async(self, version: int, batches: Iterable[Batch], *,
                      recipe: str = "nvfp4", policy: Optional[Dict[str, Any]] = None,
                      quantization_config: Union[None, str, Dict[str, Any]] = None,
                      model_id: str = "", allow_non_finite: bool = False,
                      queue_behind_active: bool = False, bucket_bytes: int = 0,
                      timeout: Any = _PUBLISHER_TIMEOUT, check: bool = True,
                      progress: Optional[Callable[[Progress], None]] = None,
                      wait: Optional[bool] = None, group: Optional["GroupSpec"] = None,
                      expected_tensors: Optional[Iterable[str]] = None,
                      release_gpu_memory: bool = False) -> PublicationFuture:
        """publish() in a background thread: returns a wpub.PublicationFuture at once, so the
        trainer can start its next step while the publication runs. Arguments as publish();
        the version, policy and flags are checked here (errors raised at once), everything else
        surfaces from future.result().

        The contract (wpub/futures.py): the iterable runs in the background thread until
        `future.sent` is set -- do not change the weights it reads before then (in an RL loop:
        wait for it before optimizer.step()); CUDA tensors and references (CudaIpc, ShmRef,
        shm_empty arrays) are read in place by the daemon until `future.released` is set, on
        every outcome. future.cancel() aborts the publication. One publication at a time per
        Publisher: FailedPrecondition while another publish()/publish_async() is in flight.
        The background thread uses the caller's current CUDA device."""
        version = check_version(version)
        header = build_header(version, recipe, policy, quantization_config, model_id,
                         allow_non_finite, queue_flag(queue_behind_active, wait), bucket_bytes,
                         release_gpu_memory)
        preamble = group_preamble(header, group, expected_tensors)
        if timeout is _PUBLISHER_TIMEOUT:
            timeout = self.timeout
        torch = sys.modules.get("torch")
        device = None
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
        future = PublicationFuture(version, lambda: self._cancel_owned(future))
        with self._lock:
            if self._active is not None:
                raise errors.FailedPrecondition("this Publisher already has a publish() in flight")
            self._active, self._owner = _STARTING, future
            self._cancel_requested = False

        def run():
            report, error = None, None
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                report = self._run(header, batches, timeout, check, progress, future, preamble)
            except BaseException as e:  # noqa: B902 -- handed to result()
                error = e
            future._finish(report, error)

        try:
            threading.Thread(target=run, name=f"wpub-publish-v{version}", daemon=True).start()
        except BaseException:
            with self._lock:
                self._active, self._owner = None, None
            raise
        return future

    def _cancel_owned(self, future: PublicationFuture) -> None:
        """Cancels the publication of `future` (and nothing else) if it is in flight."""
        with self._lock:
            if self._owner is not future:
                return
            self._cancel_requested = True
            call = self._active
        if call is not None and call is not _STARTING:
            call.cancel()

    def _run(self, header, batches: Iterable[Batch], timeout: Optional[float], check: bool,
             progress: Optional[Callable[[Progress], None]],
             future: Optional[PublicationFuture], preamble=()) -> PublicationReport:
        """One publication; `future` is set when publish_async reserved the Publisher."""
        version = header.version
        t0 = time.perf_counter()
        cpu0, caller0 = time.process_time(), time.thread_time()
        timings = ClientTimings()

        def notify(phase: str, report=None, error=None) -> None:
            if progress is None:
                return
            progress(Progress(
                version, phase, timings.batches, timings.tensors,
                timings.inline_bytes + timings.shm_bytes + timings.shm_zero_copy_bytes +
                timings.cuda_ipc_bytes, timings.inline_bytes, timings.shm_bytes,
                timings.shm_zero_copy_bytes, timings.cuda_ipc_bytes, time.perf_counter() - t0,
                report.num_buckets if report is not None else 0, report, error))

        def notify_end(phase: str, report=None, error=None) -> None:
            try:
                notify(phase, report, error)
            except Exception:  # the outcome stands; a broken callback is only logged
                _log.exception("v%d: the progress callback failed at '%s'", version, phase)

        try:
            report = self._stream(header, batches, timeout, future, timings, notify, t0,
                                  preamble)
        except BaseException as e:
            if isinstance(e, errors.WpubError):
                _log.warning("v%d not published: %s", version, e)
            else:
                _log.warning("v%d cancelled by %s: %s", version, type(e).__name__, e)
            notify_end("failed", None, e)
            raise
        timings.total_seconds = time.perf_counter() - t0
        timings.cpu_seconds = time.process_time() - cpu0
        timings.caller_cpu_seconds = time.thread_time() - caller0
        report = PublicationReport.from_proto(report, timings)
        if check and not report.committed:
            e = errors.PublicationAborted(
                f"publication v{report.version} {report.status}: {report.error_message}",
                report=report)
            _log.warning("v%d not committed: %s", version, report.summary())
            notify_end("failed", report, e)
            raise e
        (_log.info if report.committed else _log.warning)("%s", report.summary())
        notify_end("done", report)
        return report

    def _stream(self, header, batches: Iterable[Batch], timeout: Optional[float],
                future: Optional[PublicationFuture], timings: ClientTimings, notify,
                t0: float, preamble=()):
        """Sends the publication and returns the daemon's report message."""
        stream = _RequestStream(self.max_queued_messages)
        keepalive: List[Any] = []  # CUDA tensors referenced by the daemon until the report
        segments: Dict[int, ShmSegment] = {}  # batch index -> segment of this publication
        reported = False
        with self._lock:
            if future is None:
                if self._active is not None:
                    raise errors.FailedPrecondition(
                        "this Publisher already has a publish() in flight")
                self._cancel_requested = False
            call = self._publish.future(stream.requests(), timeout=timeout,
                                        metadata=self._metadata)
            self._active = call
            cancel_now = self._cancel_requested  # future.cancel() before the RPC opened
        if cancel_now:
            call.cancel()
        pending: Optional[BaseException] = None
        try:
            try:
                stream.put(pb.PublishRequest(header=header).SerializeToString(), call)
                for message in preamble:  # the group's declared manifest (the leader's)
                    stream.put(message, call)
                for b, item in enumerate(batches):
                    self._send_batch(b, item, call, stream, segments, keepalive, timings)
                    notify("send")
                stream.put(pb.PublishRequest(commit=pb.Commit()).SerializeToString(), call,
                           is_commit=True)
                _log.debug("v%d: %d batches sent, committing", header.version, timings.batches)
                notify("commit")
            except _CallEnded:
                pass  # the RPC's own status says why
            except BaseException as e:  # the iterable (or a tensor, or progress) failed, or ^C
                pending = e
                call.cancel()
            finally:
                stream.close(call)
                if future is not None:
                    future.sent.set()
            report_msg = self._wait(call)
            reported = pending is None
        except errors.WpubError as e:
            # A status from the daemon ends its publication; a cancel or deadline may not have
            # reached it yet, so its segments must not be refilled.
            reported = pending is None and not isinstance(
                e, (errors.Cancelled, errors.DeadlineExceeded, errors.Unavailable,
                    errors.PublicationAborted))
            if pending is not None:
                raise pending from None
            raise e from None
        finally:
            with self._lock:
                self._active, self._owner = None, None
            # The RPC is over: drop the CUDA tensors now rather than when a traceback holding
            # this frame is collected.
            keepalive.clear()
            # Reusable only when the daemon is done with the publication (it answered).
            self._shm.release(segments, reuse=self.reuse_shm and reported)
        if pending is not None:  # the daemon answered before seeing the cancellation
            raise pending
        timings.messages = stream.messages
        timings.send_seconds = (stream.commit_taken_at or time.perf_counter()) - t0
        return report_msg

    def _wait(self, call):
        """The call's reply; polls so that KeyboardInterrupt reaches the caller promptly (and
        cancels the publication)."""
        done = threading.Event()
        call.add_done_callback(lambda _: done.set())
        try:
            while not done.wait(_POLL_S):
                pass
        except BaseException:
            call.cancel()
            done.wait(5.0)
            raise
        try:
            return call.result()
        except grpc.FutureCancelledError:
            with self._lock:
                by_user = self._cancel_requested
            why = "by Publisher.cancel()" if by_user else "by the client"
            raise errors.Cancelled(f"publication cancelled {why}; the daemon aborts it") from None
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def _send_batch(self, b: int, item, call, stream: _RequestStream,
                    segments: Dict[int, ShmSegment],
                    keepalive: list, timings: ClientTimings) -> None:
        try:
            megatron_name, tensors = item
        except (TypeError, ValueError):
            raise TensorError(f"batch {b}: expected (megatron_name, [(hf_name, tensor), ...]), "
                              f"got {type(item).__name__}") from None
        if not isinstance(megatron_name, str):
            raise TensorError(f"batch {b}: megatron name must be a str, got "
                              f"{type(megatron_name).__name__}")
        normalized = []
        for entry in tensors:
            try:
                hf_name, tensor = entry
            except (TypeError, ValueError):
                raise TensorError(f"batch {b} ({megatron_name}): expected (hf_name, tensor) "
                                  "pairs") from None
            normalized.append(normalize(hf_name, tensor))

        threshold = self.shm_threshold_bytes
        shm_size = 0
        in_arena = {}  # id(part) -> (segment, offset) for arrays already in shared memory
        for t in normalized:
            for p in t.parts:
                if not isinstance(p, HostPart):
                    continue
                found = self._arena.find(p.array.ctypes.data, p.nbytes) if p.nbytes else None
                if found is not None:
                    in_arena[id(p)] = found
                elif threshold is not None and p.nbytes >= threshold:
                    shm_size = align(shm_size) + p.nbytes
        segment = None
        if shm_size:
            segment = segments[b] = self._shm.acquire(b, shm_size)

        req = pb.PublishRequest()
        msg = req.batch
        msg.megatron_name = megatron_name
        inline: List[Tuple[int, int, HostPart]] = []
        devices = set()
        offset = 0
        for i, t in enumerate(normalized):
            td = msg.tensors.add()
            td.name, td.dtype, td.concat_dim = t.name, t.dtype, t.concat_dim
            td.shape.extend(t.shape)
            for j, p in enumerate(t.parts):
                wp = td.parts.add()
                wp.shape.extend(p.shape)
                if isinstance(p, CudaPart):
                    ipc = wp.cuda_ipc
                    ipc.handle, ipc.device_uuid = p.handle, p.device_uuid
                    ipc.offset, ipc.length = p.offset, p.nbytes
                    keepalive.append(p.keepalive)
                    if p.device_index >= 0:  # torch tensors: sync their stream
                        devices.add(p.device_index)
                    timings.cuda_ipc_bytes += p.nbytes
                elif isinstance(p, ShmPart):  # another process's segment, by reference
                    wp.shm.name, wp.shm.offset, wp.shm.length = p.name, p.offset, p.nbytes
                    if p.keepalive is not None:
                        keepalive.append(p.keepalive)
                    timings.shm_zero_copy_bytes += p.nbytes
                elif id(p) in in_arena:
                    seg, off = in_arena[id(p)]
                    wp.shm.name, wp.shm.offset, wp.shm.length = seg.name, off, p.nbytes
                    timings.shm_zero_copy_bytes += p.nbytes
                elif segment is not None and p.nbytes >= threshold:
                    offset = align(offset)
                    segment.write(offset, p.array)
                    wp.shm.name, wp.shm.offset, wp.shm.length = segment.name, offset, p.nbytes
                    offset += p.nbytes
                    timings.shm_bytes += p.nbytes
                else:
                    wp.inline.SetInParent()
                    inline.append((i, j, p))
        if devices and self.cuda_sync:
            _sync_cuda(devices)
        stream.put(req.SerializeToString(), call)
        for i, j, p in inline:
            raw = p.array.reshape(-1).view("uint8")
            for off in range(0, p.nbytes, self.chunk_bytes):
                chunk = pb.Chunk(batch_index=b, tensor_index=i, part_index=j, offset=off,
                                 data=raw[off:off + self.chunk_bytes].tobytes())
                stream.put(pb.PublishRequest(chunk=chunk).SerializeToString(), call)
            timings.inline_bytes += p.nbytes
        timings.batches += 1
        timings.tensors += len(normalized)
        _log.debug("batch %d (%s) sent: %d tensors", b, megatron_name, len(normalized))

"""Plain-Python views of the daemon's replies: PublicationReport (with the per-phase figures
and the client's own timings), Status and EngineGroup."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ._proto import pb

_STATUS_PREFIX = "PUBLICATION_STATUS_"


@dataclass
class PhaseSeconds:
    """Seconds per phase on the daemon; phases may overlap on the GPU path."""
    ingest: float = 0.0
    policy: float = 0.0
    quantize: float = 0.0
    pack: float = 0.0
    transfer: float = 0.0
    commit: float = 0.0
    group: float = 0.0  # a group member waiting for its leader (0 outside a group)


@dataclass
class PauseWindow:
    """How long a rollout engine served nothing in a publication (wpubd's view of its answers):
    pause answered .. resume answered, split into waiting for wpub, the transfer and the
    engine's own finalization (the three add up to `seconds`)."""
    seconds: float
    waiting: float
    transfer: float
    finalization: float
    resumed: bool  # False: still paused (dirty) when the report was made


@dataclass
class ReceiverOutcome:
    name: str
    state: str
    committed: bool
    failure: str
    error: str
    family: str = ""  # a rollout engine's family ("sglang", "vllm"); "" for a pull receiver
    pause: Optional[PauseWindow] = None  # a rollout engine's pause window

    @classmethod
    def from_proto(cls, r) -> "ReceiverOutcome":
        pause = None
        if r.HasField("pause"):
            p = r.pause
            pause = PauseWindow(p.seconds, p.waiting, p.transfer, p.finalization, p.resumed)
        return cls(r.name, r.state, r.committed, r.failure, r.error, r.family, pause)


@dataclass
class ClientTimings:
    """What the publication cost on the trainer side.

    send_seconds: publish() start to the commit message handed to gRPC (every batch sent);
    total_seconds: publish() start to the report; cpu_seconds: process CPU time over the call
    (every thread, gRPC's included); caller_cpu_seconds: CPU time of the calling thread (tensor
    normalization, shm copies, message building); inline/shm/shm_zero_copy/cuda_ipc_bytes:
    payload bytes by route (shm_zero_copy: arrays from Publisher.shm_empty, not copied);
    messages: stream messages sent."""
    send_seconds: float = 0.0
    total_seconds: float = 0.0
    cpu_seconds: float = 0.0
    caller_cpu_seconds: float = 0.0
    inline_bytes: int = 0
    shm_bytes: int = 0
    shm_zero_copy_bytes: int = 0
    cuda_ipc_bytes: int = 0
    messages: int = 0
    batches: int = 0
    tensors: int = 0


@dataclass
class PublicationReport:
    """One finished publication (committed, aborted or failed)."""
    status: str  # "COMMITTED", "ABORTED", "FAILED"
    version: int
    error_code: int
    error_message: str
    model_id: str
    recipe: str
    wall_seconds: float
    phases: PhaseSeconds
    host_syncs: int
    bytes_in: int
    bytes_out: int
    bytes_out_by_format: Dict[str, int]
    tensors_quantized: int
    tensors_passthrough: int
    tensors_ignored: int
    num_buckets: int
    non_finite: int
    start_unix_nanos: int
    receivers: List[ReceiverOutcome]
    client: Optional[ClientTimings] = None
    raw: object = field(default=None, repr=False)  # the wpub.v1.PublicationReport message

    @property
    def group(self):
        """The wpub.v1.GroupSummary of a group version (None outside a group): the group, the
        outcome and, in the leader's report, every member's state, parts, bytes and phases
        (members_detail), slowest_member and failed_member."""
        if self.raw is None or not self.raw.HasField("group"):
            return None
        return self.raw.group

    @property
    def committed(self) -> bool:
        return self.status == "COMMITTED"

    @classmethod
    def from_proto(cls, m, client: Optional[ClientTimings] = None) -> "PublicationReport":
        status = pb.enum_name("PublicationStatus", m.status)
        if status.startswith(_STATUS_PREFIX):
            status = status[len(_STATUS_PREFIX):]
        p = m.phases
        return cls(
            status=status, version=m.version, error_code=m.error_code,
            error_message=m.error_message, model_id=m.model_id, recipe=m.recipe,
            wall_seconds=m.wall_seconds,
            phases=PhaseSeconds(ingest=p.ingest, policy=p.policy, quantize=p.quantize,
                                pack=p.pack, transfer=p.transfer, commit=p.commit,
                                group=p.group),
            host_syncs=m.host_syncs, bytes_in=m.bytes_in, bytes_out=m.bytes_out,
            bytes_out_by_format=dict(m.bytes_out_by_format),
            tensors_quantized=m.tensors.quantized, tensors_passthrough=m.tensors.passthrough,
            tensors_ignored=m.tensors.ignored, num_buckets=m.num_buckets,
            non_finite=m.non_finite, start_unix_nanos=m.start_unix_nanos,
            receivers=[ReceiverOutcome.from_proto(r) for r in m.receivers],
            client=client, raw=m)

    def summary(self) -> str:
        """One line for a training log."""
        p = self.phases
        line = (f"v{self.version} {self.status} in {self.wall_seconds:.3f}s "
                f"(ingest {p.ingest:.3f} policy {p.policy:.3f} quantize {p.quantize:.3f} "
                f"pack {p.pack:.3f} transfer {p.transfer:.3f} commit {p.commit:.3f}), "
                f"{self.bytes_in / 1e9:.3f} GB in, {self.bytes_out / 1e9:.3f} GB out, "
                f"{self.tensors_quantized} quantized, {self.tensors_passthrough} passed, "
                f"{len(self.receivers)} receivers")
        if self.client is not None:
            line += (f"; client: sent in {self.client.send_seconds:.3f}s, "
                     f"{self.client.cpu_seconds:.3f}s CPU")
        if self.error_message:
            line += f": {self.error_message}"
        return line


@dataclass
class ActivePublication:
    version: int
    state: str
    model_id: str
    age_seconds: float


@dataclass
class ReceiverInfo:
    name: str
    state: str
    transport: str
    last_committed_version: int
    # The version it holds whole as the daemon knows it (0: none or unknown; a dirty engine
    # holds none): below Status.committed_version it is behind.
    held_version: int = 0


@dataclass
class ReplayReport:
    """A replay of the daemon's retained committed version (wpubd --retain): a "restore" of
    engines an abort left dirty (or Publisher.restore), or a "catch_up" of engines and pull
    receivers that joined behind."""
    kind: str
    version: int
    trigger: str
    completed: bool
    preempted: bool  # a newer publication took the daemon's slot from it
    error: str
    seconds: float
    bytes: int
    buckets: int
    receivers: List[ReceiverOutcome]

    @classmethod
    def from_proto(cls, m) -> "ReplayReport":
        return cls(kind=m.kind, version=m.version, trigger=m.trigger, completed=m.completed,
                   preempted=m.preempted, error=m.error, seconds=m.seconds, bytes=m.bytes,
                   buckets=m.buckets,
                   receivers=[ReceiverOutcome.from_proto(r) for r in m.receivers])


@dataclass
class RetainedCopy:
    """The daemon's copy of the committed version (wpubd --retain)."""
    where: str  # "off", "host", "device" or "pinned"
    version: int  # 0: nothing retained (reason says why)
    bytes: int
    buckets: int
    max_bytes: int
    over_bound: int
    reason: str
    held_bytes: int = 0  # memory held now (device, pinned: two versions' worth at most)


@dataclass
class ConnectedEngine:
    """One engine of the NCCL weight-update group: ranks [rank_offset, rank_offset + gpus)."""
    url: str
    gpus: int
    rank_offset: int
    state: str  # "idle", "receiving", "staged", "failed" or "left"
    pause: str = ""  # its pause policy as its kind carries it out, "abort:flush"


@dataclass
class EngineGroup:
    """The NCCL weight-update group (Publisher.connect_engines' result; Status.engine_group).
    store_address and healthy are filled in by status() only."""
    group_name: str  # "<base>_<incarnation>_<generation>"
    world_size: int  # 1 + the engines' GPUs; the publisher is rank 0
    generation: int
    engines: List[ConnectedEngine]
    healthy: bool = True
    store_address: str = ""
    raw: object = field(default=None, repr=False)

    @classmethod
    def from_proto(cls, m) -> "EngineGroup":
        """From a ConnectEnginesResponse or an EngineGroup message."""
        return cls(
            group_name=m.group_name, world_size=m.world_size, generation=m.generation,
            engines=[ConnectedEngine(e.url, e.gpus, e.rank_offset, e.state, e.pause)
                     for e in m.engines],
            healthy=getattr(m, "healthy", True), store_address=getattr(m, "store_address", ""),
            raw=m)


@dataclass
class Status:
    """The daemon's state (GetStatus). engine_group is None on a daemon without the GPU path;
    `engines` lists the connected engines (empty then)."""
    committed_version: int
    active: Optional[ActivePublication]
    receivers: List[ReceiverInfo]
    recent_reports: List[PublicationReport]
    serving: bool
    daemon_version: str
    backend: str
    engine_group: Optional[EngineGroup] = None
    retained: Optional[RetainedCopy] = None
    recent_replays: List[ReplayReport] = field(default_factory=list)
    raw: object = field(default=None, repr=False)

    @property
    def engines(self) -> List[ConnectedEngine]:
        return self.engine_group.engines if self.engine_group is not None else []

    @classmethod
    def from_proto(cls, m) -> "Status":
        active = None
        if m.HasField("active"):
            a = m.active
            active = ActivePublication(a.version, a.state, a.model_id, a.age_seconds)
        group = EngineGroup.from_proto(m.engine_group) if m.HasField("engine_group") else None
        return cls(
            committed_version=m.committed_version, active=active,
            receivers=[ReceiverInfo(r.name, r.state, r.transport, r.last_committed_version,
                                    r.held_version)
                       for r in m.receivers],
            recent_reports=[PublicationReport.from_proto(r) for r in m.recent_reports],
            serving=m.serving, daemon_version=m.daemon_version, backend=m.backend,
            engine_group=group,
            retained=RetainedCopy(m.retained.where, m.retained.version, m.retained.bytes,
                                  m.retained.buckets, m.retained.max_bytes,
                                  m.retained.over_bound, m.retained.reason,
                                  m.retained.held_bytes),
            recent_replays=[ReplayReport.from_proto(r) for r in m.recent_replays], raw=m)

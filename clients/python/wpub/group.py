"""Publication groups: several daemons (one sidecar per training node or pipeline stage) publish
one version together, each the tensors its node holds.

    import torch.distributed as dist, wpub
    # one publishing rank per node (e.g. local rank 0 after a LocalGather), in `node_group`
    group = wpub.PublicationGroup.from_torch(wpub.Publisher.from_env(), "policy",
                                             process_group=node_group)
    outcome = group.publish(step, my_nodes_batches(), expected_tensors=all_names)
    if dist.get_rank(node_group) == 0:
        assert outcome.committed, outcome.error

Member 0 (the rank whose sidecar leads) coordinates the version: the others' sidecars join it
over gRPC, the leader checks that no tensor is published twice and that the declared manifest
is covered, lets every member transfer, and commits only when every member's receivers hold
every member's buckets; any failure aborts the version on every member, and the previous
version stays current everywhere (docs/DESIGN.md, "Publication groups")."""

from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional

from . import errors
from ._proto import pb

# Names per declaration message (each far below the daemon's message limit).
_NAMES_PER_MESSAGE = 4096


@dataclass(frozen=True)
class GroupSpec:
    """One publication's place in its group (wpub.v1.GroupMembership)."""
    name: str
    members: int
    member: int
    leader: str = ""          # the leader's gRPC address; required for member > 0
    publisher: str = ""       # how this member is named in errors (default: its daemon's host:port)
    timeout: float = 0.0      # the leader's progress timeout in seconds (0: its --group_timeout)

    def check(self) -> None:
        if not self.name:
            raise errors.InvalidArgument("group: the name must not be empty")
        if not 1 <= self.members <= 1024:
            raise errors.InvalidArgument(f"group: members {self.members} is not in [1, 1024]")
        if not 0 <= self.member < self.members:
            raise errors.InvalidArgument(
                f"group: member {self.member} is not in [0, {self.members})")
        if self.member > 0 and not self.leader:
            raise errors.InvalidArgument(f"group: member {self.member} needs the leader's address")
        if self.timeout < 0:
            raise errors.InvalidArgument("group: timeout must not be negative")

    def to_proto(self):
        return pb.GroupMembership(group=self.name, members=self.members, member=self.member,
                                  leader=self.leader, publisher=self.publisher,
                                  timeout_seconds=float(self.timeout))


def group_preamble(header, group: Optional[GroupSpec], expected: Optional[Iterable[str]]):
    """Sets header.group; returns the serialized `expected` messages to send after the header
    (the leader's declared manifest). InvalidArgument before anything is sent."""
    if group is None:
        if expected is not None:
            raise errors.InvalidArgument("expected_tensors needs group= (the leader declares)")
        return []
    group.check()
    header.group.CopyFrom(group.to_proto())
    if expected is None:
        return []
    if group.member != 0:
        raise errors.InvalidArgument(
            f"expected_tensors: only the leader (member 0) declares them; this is member "
            f"{group.member}")
    names = list(expected)
    out = []
    for i in range(0, len(names), _NAMES_PER_MESSAGE):
        chunk = names[i:i + _NAMES_PER_MESSAGE]
        out.append(pb.PublishRequest(expected=pb.ExpectedTensors(names=chunk)).SerializeToString())
    return out


@dataclass
class GroupOutcome:
    """How one group version ended, as this rank knows it. On the gathering rank (rank 0 of the
    process group) `reports` holds every member's report summary (dicts, by member), otherwise
    only this member's. `committed` is this member's report's status; on rank 0 it is True only
    when every member committed."""
    version: int
    committed: bool
    error: str
    report: Any  # this member's wpub.PublicationReport (None when publish raised)
    reports: List[dict] = field(default_factory=list)


def _summary(member: int, report, error: Optional[BaseException]) -> dict:
    if report is None:
        return {"member": member, "status": "FAILED", "error": f"{type(error).__name__}: {error}",
                "wall_seconds": 0.0, "bytes_out": 0}
    return {"member": member, "status": report.status, "error": report.error_message,
            "wall_seconds": report.wall_seconds, "bytes_out": report.bytes_out}


class PublicationGroup:
    """One member of a publication group: publishes this node's tensors through `publisher`
    (its node's sidecar) under the group's version.

    publisher: a wpub.Publisher of this node's daemon. name: the group's name. members: how
    many daemons publish each version. member: this one's index (0 leads). leader: the
    leader's daemon address as the other daemons reach it. process_group: optional
    torch.distributed group of the publishing ranks, in member order; with it, publish()
    gathers every member's outcome on its rank 0."""

    def __init__(self, publisher, name: str, members: int, member: int, leader: str = "", *,
                 process_group: Any = None, publisher_name: str = "", timeout: float = 0.0):
        self.publisher = publisher
        self.spec = GroupSpec(name, members, member, leader, publisher_name, timeout)
        self.spec.check()
        self.process_group = process_group
        self._collective = process_group is not None

    @classmethod
    def from_torch(cls, publisher, name: str, *, process_group: Any = None,
                   leader: Optional[str] = None, timeout: float = 0.0) -> "PublicationGroup":
        """A member per rank of `process_group` (default: the world): member = the rank, the
        leader = rank 0's daemon. Each rank's daemon address is `publisher.target` as the
        other daemons can reach it (give `leader` when rank 0's target is a loopback or Unix
        address the others cannot use). Collective: every rank must call it."""
        import torch.distributed as dist
        rank = dist.get_rank(process_group)
        world = dist.get_world_size(process_group)
        targets: List[Optional[str]] = [None] * world
        dist.all_gather_object(targets, publisher.target, group=process_group)
        g = cls(publisher, name, world, rank, leader or targets[0],
                process_group=process_group, timeout=timeout)
        g._collective = True  # the world group when process_group is None
        return g

    def publish(self, version: int, batches, *, expected_tensors: Optional[Iterable[str]] = None,
                **kwargs) -> GroupOutcome:
        """Publishes this member's batches under `version` (keyword arguments as
        wpub.Publisher.publish; check= is not taken: the outcome says). expected_tensors is
        the leader's only. With a process group this is collective: every member calls it,
        and rank 0's outcome covers every member."""
        kwargs.pop("check", None)
        report, error = None, None
        try:
            report = self.publisher.publish(
                version, batches, group=self.spec, check=False,
                expected_tensors=expected_tensors if self.spec.member == 0 else None, **kwargs)
        except errors.WpubError as e:
            error = e
        mine = _summary(self.spec.member, report, error)
        outcome = GroupOutcome(version=version, committed=report is not None and report.committed,
                               error=mine["error"], report=report, reports=[mine])
        if self._collective:
            import torch.distributed as dist
            group = self.process_group
            gathered = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
            dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0)
                               if group is not None else 0, group=group)
            if gathered is not None:
                outcome.reports = gathered
                outcome.committed = all(r["status"] == "COMMITTED" for r in gathered)
                errs = [f"member {r['member']}: {r['error']}" for r in gathered if r["error"]]
                outcome.error = "; ".join(errs)
        if error is not None and not self._collective:
            raise error
        return outcome

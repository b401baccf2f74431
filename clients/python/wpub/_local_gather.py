"""LocalGather: the shards of several ranks of one training node, handed to the rank that
publishes, over the trainer's own torch.distributed. Exposed as wpub.torch.LocalGather.

Only references travel (no weight is copied between ranks, nothing is all-gathered): a CUDA
shard becomes its CUDA IPC handle (cudaIpcGetMemHandle of its allocation, as publish() sends
for local tensors), a host shard is copied once into a POSIX shared-memory segment of its own
rank and travels by name. The publishing rank assembles TP shards with wpub.concat (in group
rank order, along the dimension `tp_dim` gives), so wpubd reads every part in place.

FSDP2 parameters (torch DTensors on a 1-D device mesh over the group) need no tp_dim: each rank
shares its local shard (`to_local()`, uneven and empty shards included) and the publishing rank
concatenates them along the DTensor's Shard dimension in mesh order -- no rank all-gathers a
parameter; a Replicate DTensor is published once.

    gather = wpub.torch.LocalGather(group)          # once; group: the ranks of one model copy
    for step in ...:
        train_step()
        batches = gather.share(my_batches())        # collective: every rank of the group
        outcome = None
        if gather.is_publisher:
            outcome = pub.publish(step, batches)
        gather.release(outcome)                     # collective: after it, shards may change

Lifetime contract: between share() and release() a rank must not modify or free the shards it
shared (wpubd reads them in place); release() returns on every rank only after the publishing
rank called it, i.e. after its publication ended, and returns the outcome it passed (a small
dict: version, status, committed, error).
"""

from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from .shm import ShmPool, align
from .tensors import (DTYPE_SIZES, Concat, CudaIpc, CudaPart, HostPart, ShmPart, ShmRef, Tensor,
                      TensorError, concat, dtensor_layout, normalize)

TpDim = Union[None, Callable[[str], Optional[int]], Mapping[str, Optional[int]]]

_COLUMN_PARALLEL = (".q_proj.", ".k_proj.", ".v_proj.", ".qkv_proj.", ".gate_proj.", ".up_proj.",
                    ".gate_up_proj.", ".w1.", ".w3.", "embed_tokens.", "lm_head.")
_ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight", ".w2.weight")


def hf_tp_dim(hf_name: str) -> Optional[int]:
    """The dimension along which Megatron-style tensor parallelism splits an HF tensor: 0 for
    column-parallel layers (q/k/v, gate/up, w1/w3, their biases; vocab-parallel embeddings and
    lm_head), 1 for row-parallel weights (o_proj, down_proj, w2), None for replicated tensors
    (norms, routers, row-parallel biases)."""
    if hf_name.endswith(_ROW_PARALLEL):
        return 1
    if any(marker in hf_name for marker in _COLUMN_PARALLEL):
        return 0
    return None


def _global_rank(group, group_rank: int) -> int:
    if group is None:
        return group_rank
    get = getattr(dist, "get_global_rank", None)  # torch >= 2.0
    if get is None:
        from torch.distributed import distributed_c10d
        get = distributed_c10d._get_global_rank  # torch 1.13
    return get(group, group_rank)


def _summary(outcome: Any) -> Dict[str, Any]:
    """What release() broadcasts: the report's or the exception's gist."""
    if outcome is None:
        return {"version": 0, "status": "UNKNOWN", "committed": False, "error": ""}
    if isinstance(outcome, BaseException):
        report = getattr(outcome, "report", None)
        return {"version": getattr(report, "version", 0), "status": "ERROR", "committed": False,
                "error": f"{type(outcome).__name__}: {outcome}"}
    return {"version": outcome.version, "status": outcome.status,
            "committed": bool(outcome.committed), "error": outcome.error_message}


class LocalGather:
    """Hands the shards of every rank of `group` (default: the default group) to group rank
    `dst`, the one that publishes. tp_dim: hf_name -> concat dimension of a tensor held by
    several ranks (a callable or a dict; default hf_tp_dim); None means replicated (the
    publishing rank's copy, else the lowest rank's, is published; shapes must agree).
    Group rank order must be the TP rank order. Not thread-safe; one share() at a time.

    Any backend works for the metadata (gloo on CPU; with NCCL set each rank's CUDA device
    first, as for every object collective). Two ranks on one GPU (tests, small jobs) need a
    gloo group: NCCL refuses two ranks per device."""

    def __init__(self, group=None, dst: int = 0, tp_dim: TpDim = hf_tp_dim,
                 shm_prefix: str = "wpub"):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("LocalGather needs an initialized torch.distributed process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if not 0 <= dst < self.world_size:
            raise ValueError(f"dst={dst} is not a rank of the group (size {self.world_size})")
        self.dst = dst
        self._dst_global = _global_rank(group, dst)
        self._tp_dim = tp_dim
        self._pool = None if self.is_publisher else ShmPool(shm_prefix)
        self._segments: Dict[int, Any] = {}
        self._keepalive: List[Any] = []
        self._shared = False

    @property
    def is_publisher(self) -> bool:
        return self.rank == self.dst

    def _dim(self, hf_name: str) -> Optional[int]:
        if self._tp_dim is None:
            return None
        if callable(self._tp_dim):
            return self._tp_dim(hf_name)
        return self._tp_dim.get(hf_name)

    def _local(self, hf_name: str, t) -> Tuple[Any, Optional[tuple]]:
        """(what this rank shares of `t`, its layout): a DTensor's local shard with ("shard",
        dim) or ("replicate",), checked against the group; anything else as it is, with None
        (tp_dim decides)."""
        if isinstance(t, Concat):
            if self.is_publisher:  # its own, published as it is
                return t, None
            raise TensorError(f"tensor {hf_name}: a rank shares one tensor per name "
                              "(LocalGather concatenates the ranks' shards)")
        layout = dtensor_layout(hf_name, t)
        if layout is None:
            return t, None
        mesh, local, dim = layout
        # get_coordinate() is a list in some torch releases and a tuple in others (2.11).
        coordinate = mesh.get_coordinate()
        if mesh.size() != self.world_size or list(coordinate or ()) != [self.rank]:
            raise TensorError(f"tensor {hf_name}: a DTensor over a device mesh of {mesh.size()} "
                              f"ranks where this rank is {mesh.get_coordinate()}; LocalGather's "
                              f"group has {self.world_size} ranks and this rank is {self.rank}: "
                              "give LocalGather the mesh's group (mesh.get_group())")
        return local, (("replicate",) if dim is None else ("shard", dim))

    def _describe(self, b: int, megatron_name: str, tensors) -> Tuple[str, list]:
        """One batch of this (non-publishing) rank as picklable references; host shards copied
        into this rank's segment for batch `b`."""
        normalized, layouts = [], []
        for entry in tensors:
            hf_name, t = entry
            local, layout = self._local(hf_name, t)
            normalized.append(normalize(hf_name, local))
            layouts.append(layout)
        size = 0
        for n in normalized:
            p = n.parts[0]
            if isinstance(p, HostPart) and p.nbytes:
                size = align(size) + p.nbytes
        segment = self._pool.acquire(b, size) if size else None
        if segment is not None:
            self._segments[b] = segment
        out, offset, devices = [], 0, set()
        for n, layout in zip(normalized, layouts):
            p = n.parts[0]
            if isinstance(p, CudaPart):
                ref = ("cuda", p.handle, p.device_uuid, p.offset)
                self._keepalive.append(p.keepalive)
                if p.device_index >= 0:
                    devices.add(p.device_index)
            elif isinstance(p, ShmPart):
                ref = ("shm", p.name, p.offset)
                self._keepalive.append(p.keepalive)
            elif p.nbytes == 0:
                ref = ("empty",)
            else:
                offset = align(offset)
                segment.write(offset, p.array)
                ref = ("shm", segment.name, offset)
                offset += p.nbytes
            out.append((n.name, n.dtype, tuple(n.shape), ref, layout))
        for d in devices:  # wpubd reads on its own streams: the shards must be written
            torch.cuda.current_stream(d).synchronize()
        return megatron_name, out

    @staticmethod
    def _as_tensor(dtype: str, shape, ref):
        if ref[0] == "cuda":
            return CudaIpc(ref[1], ref[2], ref[3], shape, dtype)
        if ref[0] == "shm":
            return ShmRef(ref[1], ref[2], shape, dtype)
        # An empty shard has no bytes to refer to: an empty array of the same item size.
        return Tensor(np.empty(shape, dtype=f"u{DTYPE_SIZES[dtype]}"), dtype)

    def share(self, batches: Iterable) -> Optional[List[Tuple[str, list]]]:
        """Collective over the group. Every rank passes its own conversion batches
        ((megatron_name, [(hf_name, shard), ...]) of its shards: torch CPU/CUDA tensors, numpy
        arrays, wpub.Tensor). Returns, on the publishing rank, the whole model's batches for
        Publisher.publish (batches of the same name merged in rank order; a name held by
        several ranks concatenated along its DTensor's Shard dimension, else along tp_dim);
        None on the other ranks. What one rank cannot share raises TensorError on every rank.
        Call release() on every rank before the next share()."""
        if self._shared:
            raise RuntimeError("LocalGather.share() called again before release()")
        self._shared = True
        # What a rank cannot share is told to every rank through the collective, so that all of
        # them raise (none is left waiting in it).
        mine, local, error = None, None, None
        try:
            if self.is_publisher:
                mine = [(m, [(n, *self._local(n, t)) for n, t in ts]) for m, ts in batches]
                layouts = [(n, layout) for _, ts in mine for n, _, layout in ts]
            else:
                local = [self._describe(b, m, ts) for b, (m, ts) in enumerate(batches)]
                layouts = [(e[0], e[4]) for _, ts in local for e in ts]
        except Exception as e:  # noqa: BLE001 -- every rank must reach the collective
            what = e.message if isinstance(e, TensorError) else f"{type(e).__name__}: {e}"
            error, layouts = f"rank {self.rank}: {what}", []
        gathered: List[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (error, layouts, local), group=self.group)
        problem = self._problem([g[0] for g in gathered], [g[1] for g in gathered])
        if problem:
            self._keepalive.clear()
            if self._pool is not None:
                self._pool.release(self._segments, reuse=True)
            self._shared = False
            raise TensorError(problem)
        if not self.is_publisher:
            return None
        gathered = [g[2] for g in gathered]
        merged: "OrderedDict[str, OrderedDict]" = OrderedDict()
        for r in range(self.world_size):
            if r == self.dst:
                entries = [(m, [(n, (r, t, None, layout)) for n, t, layout in ts])
                           for m, ts in mine]
            else:
                entries = [(m, [(n, (r, None, (d, s, ref), layout))
                                for n, d, s, ref, layout in ts])
                           for m, ts in gathered[r]]
            for m, ts in entries:
                slot = merged.setdefault(m, OrderedDict())
                for n, part in ts:
                    slot.setdefault(n, []).append(part)
        return [(m, [(n, self._assemble(n, parts)) for n, parts in tensors.items()])
                for m, tensors in merged.items()]

    def _problem(self, errors: List[Optional[str]], layouts: List[list]) -> str:
        """What keeps the gathered shards from forming the model, the same on every rank: a
        rank's own error, or a DTensor sharded over the mesh that some rank did not share."""
        for e in errors:
            if e:
                return e
        holders: Dict[str, List[int]] = {}
        sharded = set()
        for r, entries in enumerate(layouts):
            for name, layout in entries:
                holders.setdefault(name, []).append(r)
                if layout is not None and layout[0] == "shard":
                    sharded.add(name)
        for name in sorted(sharded):
            missing = sorted(set(range(self.world_size)) - set(holders[name]))
            if missing:
                return (f"tensor {name}: a DTensor sharded over the {self.world_size} ranks of the "
                        f"group, but ranks {missing} did not share their shards: every rank "
                        "passes every parameter to share()")
        return ""

    def _assemble(self, hf_name: str, parts: list):
        def tensor_of(part):
            _, local, remote, _ = part
            return local if remote is None else self._as_tensor(*remote)
        layouts = {p[3] for p in parts}
        if len(layouts) > 1:
            raise TensorError(f"tensor {hf_name}: ranks {[p[0] for p in parts]} hold it laid out "
                              f"differently ({sorted(map(str, layouts))})")
        layout = layouts.pop()
        if len(parts) == 1:
            return tensor_of(parts[0])
        if layout is None:
            dim = self._dim(hf_name)
        else:  # a DTensor: its placement decides, not tp_dim
            dim = layout[1] if layout[0] == "shard" else None
        if dim is None:  # replicated: publish one copy, the publisher's own when it has one
            shapes = {tuple(normalize(hf_name, tensor_of(p)).shape) for p in parts}
            if len(shapes) > 1:
                why = "tp_dim says" if layout is None else "its DTensor placement says"
                raise TensorError(f"tensor {hf_name}: ranks {[p[0] for p in parts]} hold shapes "
                                  f"{sorted(shapes)} but {why} it is replicated")
            own = [p for p in parts if p[0] == self.dst]
            return tensor_of(own[0] if own else parts[0])
        return concat([tensor_of(p) for p in parts], dim)

    def release(self, outcome: Any = None) -> Dict[str, Any]:
        """Collective over the group; the publishing rank calls it once its publication ended,
        passing the report or the exception. Returns on every rank the outcome's summary
        {version, status, committed, error}; afterwards each rank may modify or free its
        shards (its shared-memory segments are kept and refilled by the next share())."""
        payload = [_summary(outcome) if self.is_publisher else None]
        dist.broadcast_object_list(payload, src=self._dst_global, group=self.group)
        self._keepalive.clear()
        if self._pool is not None:
            self._pool.release(self._segments, reuse=True)
        self._shared = False
        return payload[0]

    def close(self) -> None:
        """Unlinks this rank's shared-memory segments (after the last release())."""
        self._keepalive.clear()
        if self._pool is not None:
            self._pool.release(self._segments, reuse=False)
            self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

"""What a trainer may hand to Publisher.publish as a tensor, normalized into parts the wire API
can describe: host bytes (numpy arrays, torch CPU tensors; sent inline or through shared
memory) or CUDA allocations (torch CUDA tensors; sent as CUDA IPC handles of their storage).

Neither numpy nor torch is required to import this module; torch is looked up only when a
torch tensor is seen (so Debian hosts without torch work)."""

import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import _cuda_ipc
from .errors import WpubError

# torch dtype name -> element size; the daemon's dtypes (core/common/tensor.h).
DTYPE_SIZES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "float8_e4m3fn": 1, "int8": 1,
    "int32": 4, "int64": 8, "float64": 8, "bool": 1,
}

_NUMPY_NAMES = {
    np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64", np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8",
    np.dtype(np.int32): "int32", np.dtype(np.int64): "int64", np.dtype(np.bool_): "bool",
}


class TensorError(WpubError):
    """A tensor handed to publish() cannot be described on the wire (client-side check); the
    message names the tensor."""


@dataclass
class Tensor:
    """A host array with an explicit wire dtype, for dtypes numpy lacks: e.g.
    ``wpub.Tensor(np_uint16_array, dtype="bfloat16")`` or ``dtype="float8_e4m3fn"`` over uint8.
    The array's item size must equal the dtype's size."""
    data: Any
    dtype: Optional[str] = None


@dataclass
class Concat:
    """A tensor assembled from parts (e.g. TP shards living in different allocations)
    concatenated along `dim` (0 or 1). Build with ``wpub.concat(parts, dim)``."""
    parts: Sequence[Any]
    dim: int = 0


@dataclass
class CudaIpc:
    """A CUDA allocation exported by another framework (cudaIpcGetMemHandle): the 64-byte
    handle, the owning GPU's UUID ("GPU-..."), the byte offset of the tensor in the allocation,
    its shape and dtype. `keepalive` is held until the report (the caller keeps the memory
    valid until then)."""
    handle: bytes
    device_uuid: str
    offset: int
    shape: Sequence[int]
    dtype: str
    keepalive: Any = None


@dataclass
class ShmRef:
    """Bytes already in a POSIX shared-memory segment the daemon can open (e.g. another local
    rank's shard, see wpub.torch.LocalGather): the segment's shm_open name ("/wpub-..."), the
    byte offset of the tensor in it, its shape and dtype. Sent as a reference, never copied;
    the segment's owner keeps it unchanged until the publication's report."""
    name: str
    offset: int
    shape: Sequence[int]
    dtype: str
    keepalive: Any = None


def concat(parts: Sequence[Any], dim: int = 0) -> Concat:
    """Describes the concatenation of `parts` along `dim` (0 or 1) without copying: the daemon
    reads every part in place. Parts must share dtype and every dimension but `dim`."""
    if dim not in (0, 1):
        raise TensorError(f"concat: dim must be 0 or 1, got {dim}")
    parts = list(parts)
    if not parts:
        raise TensorError("concat: no parts")
    return Concat(parts, dim)


@dataclass
class HostPart:
    """A part whose bytes are in this process's memory: `array` is a C-contiguous numpy array
    (any dtype) viewed as bytes at send time."""
    shape: Tuple[int, ...]
    nbytes: int
    array: np.ndarray


@dataclass
class CudaPart:
    """A part in a CUDA allocation: IPC handle of the allocation holding the storage, byte
    offset of the part inside it, device UUID. `keepalive` is the tensor itself (the caller must
    hold it until the daemon's report, so the allocator cannot reuse the memory)."""
    shape: Tuple[int, ...]
    nbytes: int
    handle: bytes
    offset: int
    device_uuid: str
    device_index: int
    keepalive: Any = field(repr=False, default=None)


@dataclass
class ShmPart:
    """A part in a shared-memory segment described by name (ShmRef)."""
    shape: Tuple[int, ...]
    nbytes: int
    name: str
    offset: int
    keepalive: Any = field(repr=False, default=None)


@dataclass
class NormalizedTensor:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    parts: List[Any]  # HostPart | CudaPart | ShmPart
    concat_dim: int = 0


def _torch():
    return sys.modules.get("torch")


def _is_torch_tensor(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def dtensor_layout(name: str, x):
    """For a torch DTensor (FSDP2 parameters; torch.distributed.tensor, or ._tensor before torch
    2.4): (the mesh, this rank's local tensor, the dimension it is sharded along or None when
    every rank holds all of it). None for anything else. TensorError naming the tensor for what
    wpub cannot assemble: a mesh of more than one dimension (HSDP, FSDP2 + TP) or a Partial
    placement (reduce it first)."""
    torch = _torch()
    if torch is None:
        return None
    dt = None
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, "DTensor"):
            dt = mod
            break
    if dt is None or not isinstance(x, dt.DTensor):
        return None
    mesh, placements = x.device_mesh, tuple(x.placements)
    if mesh.ndim != 1 or len(placements) != 1:
        raise TensorError(f"tensor {name}: a DTensor on a {mesh.ndim}-D device mesh "
                          f"{tuple(mesh.shape)} (placements {placements}); wpub assembles "
                          "1-D meshes (FSDP2): hand each rank's shards to wpub.torch.LocalGather "
                          "as plain tensors with tp_dim")
    p = placements[0]
    if p.is_shard():
        dim = int(p.dim) % max(x.dim(), 1)
        if type(p).__name__ != "Shard" or dim not in (0, 1):
            raise TensorError(f"tensor {name}: a DTensor placed {p}; wpub assembles shards along "
                              "dim 0 or 1 (FSDP2 shards dim 0)")
        return mesh, x.to_local(), dim
    if p.is_replicate():
        return mesh, x.to_local(), None
    raise TensorError(f"tensor {name}: a DTensor with placement {p} holds partial values; "
                      "reduce it (full_tensor() or redistribute to Shard/Replicate) first")


def _torch_dtype_name(t) -> str:
    name = str(t.dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


_UUID_CACHE = {}


def _device_uuid(index: int) -> str:
    """"GPU-xxxxxxxx-..." as nvidia-smi prints it (what the daemon matches its devices by)."""
    uuid = _UUID_CACHE.get(index)
    if uuid is None:
        props = _torch().cuda.get_device_properties(index)
        raw = str(getattr(props, "uuid", ""))
        if not raw:
            raise TensorError(f"cannot read the UUID of CUDA device {index} (torch too old?)")
        uuid = raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"
        _UUID_CACHE[index] = uuid
    return uuid


_CUDA_IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)
_SHAREABLE_CUDA_MALLOC = ord("c")
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")


def raw_ipc_handle(name: str, handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside a handle from torch's `_share_cuda_()` (for
    interoperating with torch-shared storages and checking our own export against torch's).
    torch before 2.2 returns the raw handle; later versions prefix it with a version byte and a
    type byte ('c': a cudaMalloc block followed by the raw handle; 'e': an expandable segment,
    which has no cudaIpc handle at all)."""
    if len(handle) == _CUDA_IPC_HANDLE_SIZE:
        return handle
    if len(handle) >= 2 and handle[1] == _SHAREABLE_EXPANDABLE_SEGMENT:
        raise TensorError(
            f"tensor {name} lives in an expandable CUDA segment, which cannot be shared by a "
            "cudaIpc handle: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the trainer")
    if (len(handle) >= 2 + _CUDA_IPC_HANDLE_SIZE and handle[1] == _SHAREABLE_CUDA_MALLOC):
        return handle[2:2 + _CUDA_IPC_HANDLE_SIZE]
    raise TensorError(f"tensor {name}: unrecognized torch CUDA shareable handle "
                      f"({len(handle)} bytes, starting {handle[:2].hex()})")


def _cuda_part(name: str, t) -> CudaPart:
    """IPC description of a CUDA tensor's bytes: the handle of the cudaMalloc allocation (the
    caching allocator's segment) holding them, and their byte offset inside it."""
    if not t.is_contiguous():
        # A strided view cannot be described as one byte range; the copy is kept alive with
        # the publication like any other tensor.
        t = t.contiguous()
    torch = _torch()
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    try:
        # A thread other than the one that made the tensor may have no context current (torch's
        # device guard does not bind one when the device is already "current"): the export
        # binds the device's primary context then.
        with torch.cuda.device(index):
            handle, offset = _cuda_ipc.export(t.data_ptr(), index)
    except _cuda_ipc.CudaIpcError as e:
        raise TensorError(f"tensor {name} cannot be shared by CUDA IPC: {e}") from None
    return CudaPart(tuple(int(d) for d in t.shape), t.numel() * t.element_size(), handle, offset,
                    _device_uuid(index), index, keepalive=t)


def _host_array_from_torch(t) -> np.ndarray:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    name = _torch_dtype_name(t)
    size = t.element_size()
    if name not in DTYPE_SIZES:
        raise TensorError(f"dtype {name} is not supported by wpub")
    torch = _torch()
    # numpy has no bf16/fp8: reinterpret the bytes as an unsigned integer of the same size.
    view_as = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    if name in ("bfloat16", "float8_e4m3fn"):
        t = t.view(view_as)
    return t.numpy()


def _one_part(name: str, x, explicit_dtype: Optional[str]):
    """(dtype name, part) of one tensor-like `x`."""
    if isinstance(x, Tensor):
        return _one_part(name, x.data, x.dtype)
    if isinstance(x, ShmRef):
        size = DTYPE_SIZES.get(x.dtype)
        if size is None:
            raise TensorError(f"tensor {name}: dtype {x.dtype} is not supported by wpub")
        if not isinstance(x.name, str) or not x.name.startswith("/") or "/" in x.name[1:]:
            raise TensorError(f"tensor {name}: shared-memory name {x.name!r} must be '/name' "
                              "with no other '/'")
        shape = tuple(int(d) for d in x.shape)
        nbytes = size * int(np.prod(shape, dtype=np.int64))
        return x.dtype, ShmPart(shape, nbytes, x.name, int(x.offset), keepalive=x.keepalive)
    if isinstance(x, CudaIpc):
        size = DTYPE_SIZES.get(x.dtype)
        if size is None:
            raise TensorError(f"tensor {name}: dtype {x.dtype} is not supported by wpub")
        shape = tuple(int(d) for d in x.shape)
        nbytes = size * int(np.prod(shape, dtype=np.int64))
        return x.dtype, CudaPart(shape, nbytes, bytes(x.handle), int(x.offset), x.device_uuid,
                                 -1, keepalive=x.keepalive)
    layout = dtensor_layout(name, x) if _is_torch_tensor(x) else None
    if layout is not None:
        mesh, local, dim = layout
        if dim is not None and mesh.size() > 1:
            raise TensorError(f"tensor {name}: a DTensor sharded along dim {dim} over "
                              f"{mesh.size()} ranks; this rank holds only its shard: publish "
                              "through wpub.torch.LocalGather over the mesh's group (each rank "
                              "shares its local shard, no rank gathers the whole tensor)")
        return _one_part(name, local, explicit_dtype)
    if _is_torch_tensor(x):
        dtype = _torch_dtype_name(x)
        if explicit_dtype is not None and explicit_dtype != dtype:
            raise TensorError(f"tensor {name}: explicit dtype {explicit_dtype} differs from the "
                              f"torch tensor's {dtype}")
        if dtype not in DTYPE_SIZES:
            raise TensorError(f"tensor {name}: dtype {dtype} is not supported by wpub "
                              f"(supported: {', '.join(DTYPE_SIZES)})")
        if x.is_cuda and x.numel() == 0:  # no allocation to share: an empty host part
            return dtype, HostPart(tuple(int(d) for d in x.shape), 0, np.empty(0, np.uint8))
        if x.is_cuda:
            return dtype, _cuda_part(name, x)
        arr = _host_array_from_torch(x)
        return dtype, HostPart(tuple(int(d) for d in x.shape), arr.nbytes, arr)
    if isinstance(x, np.ndarray):
        arr = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        if explicit_dtype is not None:
            size = DTYPE_SIZES.get(explicit_dtype)
            if size is None:
                raise TensorError(f"tensor {name}: dtype {explicit_dtype} is not supported by "
                                  f"wpub (supported: {', '.join(DTYPE_SIZES)})")
            if arr.dtype.itemsize != size:
                raise TensorError(f"tensor {name}: numpy item size {arr.dtype.itemsize} "
                                  f"({arr.dtype}) does not match dtype {explicit_dtype} "
                                  f"({size} bytes)")
            dtype = explicit_dtype
        elif arr.dtype.name == "bfloat16":  # ml_dtypes' numpy bfloat16
            dtype = "bfloat16"
        else:
            dtype = _NUMPY_NAMES.get(arr.dtype)
            if dtype is None:
                hint = (" (for bfloat16 pass wpub.Tensor(array, dtype='bfloat16'))"
                        if arr.dtype.itemsize == 2 else "")
                raise TensorError(f"tensor {name}: numpy dtype {arr.dtype} is not supported"
                                  f"{hint}")
        return dtype, HostPart(tuple(int(d) for d in arr.shape), arr.nbytes, arr)
    raise TensorError(f"tensor {name}: unsupported type {type(x).__name__} (expected a numpy "
                      "array, a torch tensor, wpub.Tensor, wpub.CudaIpc, wpub.ShmRef or "
                      "wpub.concat(...))")


def normalize(name: str, x) -> NormalizedTensor:
    """Describes one HF tensor (any supported form) as wire parts; raises TensorError naming
    `name` when it cannot be."""
    if not isinstance(name, str) or not name:
        raise TensorError(f"tensor name must be a non-empty str, got {name!r}")
    if not isinstance(x, Concat):
        dtype, part = _one_part(name, x, None)
        return NormalizedTensor(name, dtype, part.shape, [part])
    dtype = None
    parts = []
    for i, p in enumerate(x.parts):
        d, part = _one_part(f"{name} part {i}", p, None)
        if dtype is not None and d != dtype:
            raise TensorError(f"tensor {name}: part {i} has dtype {d}, part 0 has {dtype}")
        dtype = d
        parts.append(part)
    rank = len(parts[0].shape)
    if rank <= x.dim:
        raise TensorError(f"tensor {name}: concat dim {x.dim} is out of range for rank {rank}")
    shape = list(parts[0].shape)
    for i, p in enumerate(parts[1:], start=1):
        if len(p.shape) != rank or any(
                a != b for d, (a, b) in enumerate(zip(p.shape, parts[0].shape)) if d != x.dim):
            raise TensorError(f"tensor {name}: part {i} shape {list(p.shape)} does not match part "
                              f"0 shape {list(parts[0].shape)} outside dim {x.dim}")
        shape[x.dim] += p.shape[x.dim]
    return NormalizedTensor(name, dtype, tuple(shape), parts, x.dim if len(parts) > 1 else 0)

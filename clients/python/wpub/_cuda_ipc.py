"""Exports CUDA allocations by cudaIpc handle through the CUDA driver API (ctypes on
libcuda.so.1), for torch CUDA tensors.

torch's own `UntypedStorage._share_cuda_()` is not used: it registers every shared storage with
torch's cross-process reference counting, which expects a torch consumer to release it; wpubd is
no torch process, so each shared block would stay in torch's "limbo" (never reused) until the
trainer exits, leaking the converted tensors of every step. The driver calls export the same
handle (that of the cudaMalloc allocation holding the tensor, as torch's allocator does) and
nothing else."""

import ctypes
from typing import Optional, Tuple

_HANDLE_SIZE = 64  # sizeof(CUipcMemHandle)


class CudaIpcError(RuntimeError):
    pass


class _Driver:
    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaIpcError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from e
        self._range = lib.cuMemGetAddressRange_v2
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                ctypes.c_uint64]
        self._range.restype = ctypes.c_int
        self._handle = lib.cuIpcGetMemHandle
        self._handle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        self._handle.restype = ctypes.c_int
        self._get_ctx = lib.cuCtxGetCurrent
        self._get_ctx.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._get_ctx.restype = ctypes.c_int
        self._set_ctx = lib.cuCtxSetCurrent
        self._set_ctx.argtypes = [ctypes.c_void_p]
        self._set_ctx.restype = ctypes.c_int
        self._retain = lib.cuDevicePrimaryCtxRetain
        self._retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self._retain.restype = ctypes.c_int
        self._primary = {}  # device -> its primary context (retained once, for the process)
        self._name = lib.cuGetErrorName
        self._name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._name.restype = ctypes.c_int

    def _error(self, code: int) -> str:
        s = ctypes.c_char_p()
        if self._name(code, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return f"CUresult {code}"

    def ensure_context(self, device: int) -> None:
        """Makes `device`'s primary context current on this thread when none is: a thread the
        trainer started (a publishing thread) has none until a runtime call binds one, and the
        driver calls below need one. torch's tensors live in the primary context."""
        cur = ctypes.c_void_p()
        if self._get_ctx(ctypes.byref(cur)) == 0 and cur.value:
            return
        ctx = self._primary.get(device)
        if ctx is None:
            ctx = ctypes.c_void_p()
            rc = self._retain(ctypes.byref(ctx), device)
            if rc != 0:
                raise CudaIpcError(f"cuDevicePrimaryCtxRetain({device}): {self._error(rc)}")
            self._primary[device] = ctx
        rc = self._set_ctx(ctx)
        if rc != 0:
            raise CudaIpcError(f"cuCtxSetCurrent: {self._error(rc)}")

    def export(self, ptr: int, device: Optional[int] = None) -> Tuple[bytes, int]:
        """(64-byte IPC handle of the allocation containing `ptr`, offset of `ptr` in it). With
        `device`, its primary context is made current first when the thread has none;
        otherwise the device's context must be current on the calling thread."""
        if device is not None:
            self.ensure_context(device)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc != 0:
            raise CudaIpcError(f"cuMemGetAddressRange: {self._error(rc)}")
        buf = ctypes.create_string_buffer(_HANDLE_SIZE)
        rc = self._handle(buf, base)
        if rc != 0:
            raise CudaIpcError(
                f"cuIpcGetMemHandle: {self._error(rc)} (memory from expandable segments or "
                "cuMemCreate cannot be shared this way: set PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:False in the trainer)")
        return buf.raw, ptr - base.value


_DRIVER: Optional[_Driver] = None


def export(ptr: int, device: Optional[int] = None) -> Tuple[bytes, int]:
    """Module-level entry: loads the driver on first use."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = _Driver()
    return _DRIVER.export(ptr, device)

"""Child process of test_gpu_ipc: opens CUDA IPC references the way wpubd's GPU path does
(cuIpcOpenMemHandle on the device named by UUID, then the byte range at the offset) and prints
the SHA-256 of each part's bytes, so the parent can check the exported (handle, offset) pairs
describe exactly the tensors' bytes. Reads JSON [{handle, device_uuid, offset, length}] on
stdin; prints one hex digest per line."""

import ctypes
import hashlib
import json
import sys

import torch


def main():
    parts = json.load(sys.stdin)
    by_uuid = {}
    for i in range(torch.cuda.device_count()):
        raw = str(torch.cuda.get_device_properties(i).uuid)
        by_uuid[raw if raw.startswith("GPU-") else f"GPU-{raw}"] = i
    class IpcHandle(ctypes.Structure):  # CUipcMemHandle, passed by value
        _fields_ = [("reserved", ctypes.c_char * 64)]

    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcHandle,
                                           ctypes.c_uint]
    cuda.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cuda.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
    opened = {}
    for p in parts:
        index = by_uuid[p["device_uuid"]]
        with torch.cuda.device(index):
            torch.cuda.current_stream().synchronize()  # context current on this thread
            key = (p["handle"], index)
            if key not in opened:  # a handle may be opened once per process
                ptr = ctypes.c_uint64()
                h = IpcHandle.from_buffer_copy(bytes.fromhex(p["handle"]))
                rc = cuda.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), h, 1)
                if rc != 0:
                    raise SystemExit(f"cuIpcOpenMemHandle failed: {rc}")
                opened[key] = ptr.value
            buf = ctypes.create_string_buffer(p["length"])
            rc = cuda.cuMemcpyDtoH_v2(buf, opened[key] + p["offset"], p["length"])
            if rc != 0:
                raise SystemExit(f"cuMemcpyDtoH failed: {rc}")
            print(hashlib.sha256(buf.raw).hexdigest(), flush=True)
    for ptr in opened.values():
        cuda.cuIpcCloseMemHandle(ptr)


if __name__ == "__main__":
    main()

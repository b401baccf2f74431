"""Exceptions of the wpub client: one class per gRPC status code the daemon uses, each carrying
the daemon's message (which names the tensor, field or receiver at fault)."""

import re
from typing import Optional

import grpc


class WpubError(Exception):
    """Base of every wpub error. `code` is the grpc.StatusCode (None for client-side errors),
    `message` the daemon's (or the client's) explanation."""

    code: Optional[grpc.StatusCode] = None

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None, report=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.report = report  # PublicationReport when the daemon sent one

    def __str__(self) -> str:
        name = self.code.name if self.code is not None else "CLIENT"
        return f"{name}: {self.message}"


class InvalidArgument(WpubError):
    """Bad input: unknown dtype, shape/byte-count mismatch, K % 16 != 0, incomplete gate/up
    pair, bad regex rule, non-finite weights..."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(WpubError):
    """The daemon's state forbids it: version not increasing, another publication active."""
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unimplemented(WpubError):
    """The daemon lacks the feature (e.g. CUDA IPC ingestion on a daemon without the GPU path)."""
    code = grpc.StatusCode.UNIMPLEMENTED


class Unauthenticated(WpubError):
    """Missing or wrong bearer token."""
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(WpubError):
    """The daemon may not open a resource (e.g. a shared-memory segment)."""
    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(WpubError):
    """The call's deadline passed; a publication in flight is aborted on the daemon."""
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(WpubError):
    """The call was cancelled (Publisher.cancel(), or the daemon cancelled it)."""
    code = grpc.StatusCode.CANCELLED


class Unavailable(WpubError):
    """The daemon cannot be reached, or is shutting down."""
    code = grpc.StatusCode.UNAVAILABLE


class NotFound(WpubError):
    """A named resource is missing (e.g. a shared-memory segment)."""
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(WpubError):
    """A size limit was exceeded (chunk size, inline bytes of a publication)."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OutOfRange(WpubError):
    """A byte range lies outside its shared-memory segment or part."""
    code = grpc.StatusCode.OUT_OF_RANGE


class Aborted(WpubError):
    """The daemon aborted the operation."""
    code = grpc.StatusCode.ABORTED


class DataLoss(WpubError):
    """A checksum did not match."""
    code = grpc.StatusCode.DATA_LOSS


class Internal(WpubError):
    """An internal daemon error."""
    code = grpc.StatusCode.INTERNAL


class PublicationAborted(WpubError):
    """Publish returned normally but the publication did not commit (a receiver failed or left,
    the daemon shut down...): every receiver keeps the previous version. `report` holds the
    per-receiver outcome."""
    code = grpc.StatusCode.ABORTED


class DaemonShuttingDown(Unavailable, PublicationAborted):
    """The daemon is shutting down (SIGTERM, drain deadline): the publication in flight was
    aborted, or a new one refused; every receiver keeps the previous version. Both a
    wpub.Unavailable (retry once the daemon is back) and a wpub.PublicationAborted (`report` is
    None: the daemon sent none)."""


# What the daemon answers a stream message for a publication it ended on its own (a shutdown,
# a receiver failure, a deadline) while the client was still sending: FAILED_PRECONDITION
# "publication <v> has ended: <the status that ended it>".
_ENDED = re.compile(r"publication \d+ has ended: (.*)", re.S)


def _is_shutdown(message: str) -> bool:
    m = message.lower()
    return "shutting down" in m or "shutdown deadline" in m or "shut down" in m


_BY_CODE = {
    cls.code: cls
    for cls in (InvalidArgument, FailedPrecondition, Unimplemented, Unauthenticated,
                PermissionDenied, DeadlineExceeded, Cancelled, Unavailable, NotFound,
                ResourceExhausted, OutOfRange, Aborted, DataLoss, Internal)
}


def error_for(code: grpc.StatusCode, message: str) -> WpubError:
    """The exception for a gRPC status (WpubError itself for codes without a class)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return WpubError(message, code)
    return cls(message)


def from_rpc_error(e: grpc.RpcError) -> WpubError:
    """Converts a grpc.RpcError (a grpc.Call) into the matching WpubError. A publication the
    daemon ended while the client was sending is a PublicationAborted (DaemonShuttingDown when
    the daemon is going away), not the FAILED_PRECONDITION the late message got."""
    try:
        code, details = e.code(), e.details()
    except Exception:  # not a Call: a channel-level failure
        code, details = grpc.StatusCode.UNKNOWN, str(e)
    details = details or ""
    ended = _ENDED.match(details) if code == grpc.StatusCode.FAILED_PRECONDITION else None
    if ended is not None:
        if _is_shutdown(ended.group(1)):
            return DaemonShuttingDown(details)
        return PublicationAborted(details)
    if code == grpc.StatusCode.UNAVAILABLE and _is_shutdown(details):
        return DaemonShuttingDown(details)
    return error_for(code, details)

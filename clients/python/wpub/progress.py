"""Progress of one publication, as Publisher.publish(progress=...) reports it."""

from dataclasses import dataclass
from typing import Optional

from .report import PublicationReport


@dataclass
class Progress:
    """A snapshot handed to the progress callback.

    phase: "send" after each conversion batch was handed to gRPC; "commit" once every batch is
    sent and the daemon quantizes, transfers and commits; "done" when the report arrived
    (`report` set: buckets, bytes out, receivers); "failed" when the publication ended without
    committing (`error` set; `report` too when the daemon sent one).
    batches, tensors: sent so far. bytes_sent: payload bytes described so far (all routes);
    inline/shm/shm_zero_copy/cuda_ipc_bytes: the same by route. elapsed_seconds: since
    publish() started. buckets: the daemon's bucket count (known at "done"/"failed" only; the
    daemon reports it with the publication)."""
    version: int
    phase: str
    batches: int = 0
    tensors: int = 0
    bytes_sent: int = 0
    inline_bytes: int = 0
    shm_bytes: int = 0
    shm_zero_copy_bytes: int = 0
    cuda_ipc_bytes: int = 0
    elapsed_seconds: float = 0.0
    buckets: int = 0
    report: Optional[PublicationReport] = None
    error: Optional[BaseException] = None

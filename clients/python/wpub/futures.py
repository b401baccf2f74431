"""PublicationFuture: the handle Publisher.publish_async returns.

The contract (also in clients/python/README.md, "Publishing asynchronously"):
- The conversion batches are consumed in a background thread. Until `sent` is set, the
  iterable may still run: the trainer must not change what it reads (the model's weights).
- `sent` (a threading.Event) is set once the iterable is exhausted (or the publication ended
  early) and every host payload that travels by copy (inline chunks, shared-memory segments of
  the Publisher) was copied: from then on those sources may be modified.
- `released` is set when the publication ended, whatever the outcome: the daemon reads nothing
  more. CUDA tensors (shared by CUDA IPC), Publisher.shm_empty arrays and wpub.ShmRef/CudaIpc
  references are read in place by the daemon until then; modify or free them only after
  `released`. A publication that did not commit is discarded by every receiver, so modifying its
  sources after `released` is always safe.
- cancel() aborts the publication (the daemon aborts it, receivers keep the previous version);
  result() then raises wpub.Cancelled. It returns False once the publication has ended.
"""

import logging
import threading
from typing import Callable, List, Optional

from .report import PublicationReport

_log = logging.getLogger(__name__)


class PublicationFuture:
    """The outcome of one publish_async(). Thread-safe."""

    def __init__(self, version: int, cancel_fn: Callable[[], None]):
        self.version = version
        self.sent = threading.Event()
        self.released = threading.Event()
        self._cancel_fn = cancel_fn
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._report: Optional[PublicationReport] = None
        self._error: Optional[BaseException] = None
        self._cancel_requested = False
        self._callbacks: List[Callable[["PublicationFuture"], None]] = []

    def done(self) -> bool:
        """True once the publication ended (result() no longer blocks)."""
        return self._done.is_set()

    def cancel(self) -> bool:
        """Cancels the publication if it is still running; True if a cancellation was sent."""
        with self._lock:
            if self._done.is_set():
                return False
            self._cancel_requested = True
        self._cancel_fn()
        return True

    def cancelled(self) -> bool:
        """True when cancel() was called before the publication ended."""
        with self._lock:
            return self._cancel_requested and self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> PublicationReport:
        """The report; raises what publish() would have raised. TimeoutError after `timeout`
        seconds (the publication goes on)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"publication v{self.version} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._report

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The exception result() would raise, or None."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"publication v{self.version} still running after {timeout} s")
        return self._error

    def add_done_callback(self, fn: Callable[["PublicationFuture"], None]) -> None:
        """Calls fn(self) once done: in the publishing thread, or at once if already done."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # -- set by the publishing thread ------------------------------------------------------

    def _finish(self, report: Optional[PublicationReport], error: Optional[BaseException]):
        with self._lock:
            self._report, self._error = report, error
            self.sent.set()
            self.released.set()
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback's failure must not hide the publication's outcome
                _log.exception("publish_async done callback failed")

    def __repr__(self) -> str:
        state = "done" if self.done() else ("sent" if self.sent.is_set() else "sending")
        return f"<PublicationFuture v{self.version} {state}>"

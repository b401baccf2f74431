"""The bounded hand-off between a publication's producing (calling) thread and gRPC's sending
thread (wpub.Publisher): a slow daemon blocks the trainer through gRPC flow control instead of
buffering the model in memory."""

import queue
import time
from typing import Optional

_END = object()  # sentinel ending the request stream
_POLL_S = 0.05  # how often a blocked wait re-checks whether the RPC ended


class _CallEnded(Exception):
    """The RPC finished (daemon error, deadline, cancel) while we were still producing."""


class _RequestStream:
    """The bounded hand-off between the producing (calling) thread and gRPC's sender."""

    def __init__(self, max_messages: int):
        self._q: "queue.Queue" = queue.Queue(maxsize=max_messages)
        self.commit_taken_at: Optional[float] = None
        self.messages = 0

    def requests(self):  # runs in gRPC's request-consumer thread
        while True:
            item = self._q.get()
            if item is _END:
                return
            data, is_commit = item
            if is_commit:
                self.commit_taken_at = time.perf_counter()
            yield data

    def put(self, data: bytes, call, is_commit: bool = False) -> None:
        """Blocks while gRPC is behind; raises _CallEnded once the RPC is over."""
        while True:
            if call.done():
                raise _CallEnded()
            try:
                self._q.put((data, is_commit), timeout=_POLL_S)
                self.messages += 1
                return
            except queue.Full:
                continue

    def close(self, call) -> None:
        """Ends the stream after everything queued was sent; once the RPC is over, drops what
        is unsent instead (gRPC's consumer thread may be blocked waiting for a message)."""
        while True:
            try:
                self._q.put(_END, timeout=_POLL_S)
                return
            except queue.Full:
                if call.done():
                    break
        while True:
            try:
                self._q.put_nowait(_END)
                return
            except queue.Full:
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    pass

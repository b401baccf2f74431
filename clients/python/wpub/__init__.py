"""wpub: the trainer-side client of wpubd, the weight-publication daemon.

    import wpub
    pub = wpub.Publisher("127.0.0.1:50151")
    report = pub.publish(step, converter(model), recipe="nvfp4")

wpub.torch (optional, needs torch) publishes torch modules and state dicts and gathers the
shards of several local ranks. See clients/python/README.md for the RL-loop example and the
tensor forms accepted."""

import logging as _logging

from ._version import __version__
from .errors import (Aborted, Cancelled, DaemonShuttingDown, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                     PermissionDenied, PublicationAborted, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, WpubError)
from .futures import PublicationFuture
from .group import GroupOutcome, GroupSpec, PublicationGroup
from .progress import Progress
from .publisher import Publisher
from .report import (ActivePublication, ClientTimings, ConnectedEngine, EngineGroup,
                     PauseWindow, PhaseSeconds, PublicationReport, ReceiverInfo, ReceiverOutcome,
                     ReplayReport,
                     RetainedCopy, Status)
from .tensors import Concat, CudaIpc, ShmRef, Tensor, TensorError, concat

# Loggers are "wpub.<module>"; nothing is printed unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "__version__", "Publisher", "PublicationGroup", "GroupSpec", "GroupOutcome",
    "PublicationFuture", "Progress", "PublicationReport",
    "PhaseSeconds", "ClientTimings", "ReceiverOutcome", "PauseWindow", "Status", "ActivePublication", "ReceiverInfo", "EngineGroup", "ConnectedEngine", "ReplayReport",
    "RetainedCopy", "Tensor",
    "CudaIpc", "ShmRef", "Concat", "concat",
    "WpubError",
    "TensorError", "InvalidArgument", "FailedPrecondition", "Unimplemented", "Unauthenticated",
    "PermissionDenied", "DeadlineExceeded", "Cancelled", "Unavailable", "NotFound",
    "ResourceExhausted", "OutOfRange", "Aborted", "DataLoss", "Internal", "PublicationAborted",
    "DaemonShuttingDown",
]

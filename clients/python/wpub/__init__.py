"""wpub: the trainer-side client of wpubd, the weight-publication daemon.

    import wpub
    pub = wpub.Publisher("127.0.0.1:50151")
    report = pub.publish(step, converter(model), recipe="nvfp4")

See clients/python/README.md for the RL-loop example and the tensor forms accepted."""

from .errors import (Aborted, Cancelled, DataLoss, DeadlineExceeded, FailedPrecondition,
                     Internal, InvalidArgument, NotFound, OutOfRange, PermissionDenied,
                     PublicationAborted, ResourceExhausted, Unauthenticated, Unavailable,
                     Unimplemented, WpubError)
from .publisher import Publisher
from .report import (ActivePublication, ClientTimings, ConnectedEngine, EngineGroup,
                     PhaseSeconds, PublicationReport, ReceiverInfo, ReceiverOutcome, Status)
from .tensors import Concat, CudaIpc, Tensor, TensorError, concat

__version__ = "0.1.0"

__all__ = [
    "Publisher", "PublicationReport", "PhaseSeconds", "ClientTimings", "ReceiverOutcome",
    "Status", "ActivePublication", "ReceiverInfo", "EngineGroup", "ConnectedEngine", "Tensor",
    "CudaIpc", "Concat", "concat",
    "WpubError",
    "TensorError", "InvalidArgument", "FailedPrecondition", "Unimplemented", "Unauthenticated",
    "PermissionDenied", "DeadlineExceeded", "Cancelled", "Unavailable", "NotFound",
    "ResourceExhausted", "OutOfRange", "Aborted", "DataLoss", "Internal", "PublicationAborted",
]

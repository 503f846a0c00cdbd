"""refit: the Python client of refitd, the per-node daemon that moves policy weights from RL
trainers to inference engines.

Trainer:

    import refit
    client = refit.Client()                                    # $REFIT_SOCKET or the default
    buf = client.register("policy", refit.SOURCE, model.state_dict())
    for step in range(1, steps + 1):
        train_step()
        buf.copy_from(model.state_dict())                      # into shared memory
        client.publish("policy", step, [buf])                  # snapshot; overwrite at once

Inference engine:

    dst = client.register("policy", refit.DESTINATION, engine_model.state_dict())
    dst.bind(engine_model)                                     # the model lives in the region
    with client.watch("policy") as versions:
        for event in versions:
            client.apply("policy", [dst], event.version)

A torch 2.x trainer (FSDP2, tensor parallel) publishes its sharded model without slices or
copies: `refit.torch.publisher(client, "policy", model).publish(step)`; a Hugging Face or TRL
Trainer through `refit.hf.PublishCallback`. Neither is imported by `import refit`.

See client/python/README.md.
"""

try:
    from refit.v1 import refit_pb2, refit_pb2_grpc  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise ImportError(
        "refit: the gRPC stubs refit/v1/refit_pb2.py are missing; pip install ./client/python, "
        "or in a checkout run client/python/generate.sh (Bazel: //client/python:refit)") from e

try:
    from refit._version import __version__  # written by the pip build (setup.py)
except ImportError:  # a checkout on PYTHONPATH: the repository's VERSION
    import os as _os
    try:
        with open(_os.path.join(_os.path.dirname(__file__), "..", "..", "..", "VERSION"),
                  encoding="utf-8") as _f:
            __version__ = _f.read().strip()
    except OSError:
        __version__ = "unknown"

from refit.buffer import Buffer, Slice, SliceLayout
from refit.client import Client, Watch, default_socket_path
from refit.dtypes import REFIT_TO_TORCH, TORCH_TO_REFIT
from refit.errors import (CancelledError, DeadlineExceededError, FailedPreconditionError,
                          InvalidArgumentError, NotFoundError, PermissionDeniedError,
                          RefitError, ResourceExhaustedError, UnavailableError)

SOURCE = refit_pb2.SOURCE
DESTINATION = refit_pb2.DESTINATION
pb = refit_pb2

__all__ = [
    "Buffer", "CancelledError", "Client", "DeadlineExceededError", "DESTINATION",
    "FailedPreconditionError", "InvalidArgumentError", "NotFoundError", "PermissionDeniedError",
    "REFIT_TO_TORCH",
    "RefitError", "ResourceExhaustedError", "SOURCE", "Slice", "SliceLayout", "TORCH_TO_REFIT", "UnavailableError", "Watch",
    "__version__", "default_socket_path", "pb",
]

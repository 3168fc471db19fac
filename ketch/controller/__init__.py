"""The single controller: worker base, `@register` with dispatch modes, and worker groups."""

from ketch.controller.decorator import register, registered_methods
from ketch.controller.dispatch import (
    ALL_TO_ALL,
    DP_COMPUTE_PROTO,
    ONE_TO_ALL,
    PROCESS_COMPUTE_PROTO,
    RANK_ZERO,
    DataParallelLayout,
    DispatchMode,
    get_dispatch_mode,
    register_dispatch_mode,
)
from ketch.controller.local import LocalWorkerGroup
from ketch.controller.worker import Worker

__all__ = [
    "ALL_TO_ALL",
    "DP_COMPUTE_PROTO",
    "ONE_TO_ALL",
    "PROCESS_COMPUTE_PROTO",
    "RANK_ZERO",
    "DataParallelLayout",
    "DispatchMode",
    "LocalWorkerGroup",
    "Worker",
    "get_dispatch_mode",
    "register",
    "register_dispatch_mode",
    "registered_methods",
]

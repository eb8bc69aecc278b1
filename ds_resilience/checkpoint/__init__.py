"""In-memory checkpoints (Gemini): staging of a training state into one checksummed payload, and a
versioned, atomic snapshot store in host shared memory (``/dev/shm``) that outlives a worker crash."""

from .staging import ALIGN, Layout, StagedState, StagingPipeline, TensorMeta, unflatten
from .store import (
    CheckpointCorrupt,
    CheckpointError,
    CorruptVersion,
    ReplicaBytes,
    SnapshotInfo,
    SnapshotStore,
)

__all__ = [
    "ALIGN",
    "CheckpointCorrupt",
    "CheckpointError",
    "CorruptVersion",
    "Layout",
    "ReplicaBytes",
    "SnapshotInfo",
    "SnapshotStore",
    "StagedState",
    "StagingPipeline",
    "TensorMeta",
    "unflatten",
]

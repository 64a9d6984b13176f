"""Reference trainer: versioned backward graphs and logical-rank training in plain PyTorch.

The public API (docs/api.md) is re-exported here; ``import reference_trainer as rt``.
This package imports nothing of the harness (``validation``, ``canaries``, ...).

Its layers, lowest first: the core (every module beside this one, ``errors.py``,
``peers.py`` and ``trainer.py`` included), the logical-rank runtime ``ranks/``
(which drives a ``Trainer``; the rest of the project reaches it through its
``__init__``), and this boundary. A module imports its own layer or a lower one,
never a higher (tests/test_architecture.py, ``TRAINER_LAYERS``).
"""

from .behaviour import BehaviourStats
from .calibration import PlannerCalibration
from .checkpoints import BASE, AdamWConfig, Checkpoint, CheckpointVersion
from .errors import (
    CheckpointBusyError,
    CheckpointReplacedError,
    ConfigError,
    CorruptSaveError,
    EngineBusyError,
    GradientCommitError,
    MemoryAdmissionError,
    PeerError,
    PublicationError,
    SaveInForceError,
    StaleGradientError,
    TrainerError,
    UnsupportedSavedStateError,
    VersionConflictError,
)
from .importance import CorrectionStats, RatioStats
from .inputs import ForwardInput, ForwardOutput
from .lora import LoRAAdapter, LoRAConfig
from .misses import PlannerMiss, observe_planner_misses, replay_estimate
from .model import DecoderLM, ModelConfig, token_logprobs
from .options import UNSET, ForwardOptions, ImportanceCorrection, ResolvedOptions, resolve_options
from .planner import PlacementDecision
from .ranks import (
    LogicalBatch,
    LogicalLayout,
    LogicalRank,
    RankZero,
    TrafficCount,
    init_distributed,
    logical_batches,
    logical_gradients,
    logical_traffic,
    run_logical,
)
from .residency import mark_quantized_saved_state
from .rollout import Generation, PublicationReport, RolloutEngine, WeightPublication
from .trainer import BackwardReport, CheckpointStep, RecordReport, StepReport, Trainer

__all__ = [
    "run_logical",
    "logical_gradients",
    "logical_traffic",
    "TrafficCount",
    "logical_batches",
    "init_distributed",
    "RankZero",
    "PeerError",
    "LogicalRank",
    "LogicalLayout",
    "LogicalBatch",
    "BASE",
    "EngineBusyError",
    "Generation",
    "PublicationError",
    "PublicationReport",
    "RolloutEngine",
    "VersionConflictError",
    "WeightPublication",
    "AdamWConfig",
    "BackwardReport",
    "BehaviourStats",
    "Checkpoint",
    "CheckpointBusyError",
    "CheckpointReplacedError",
    "CheckpointStep",
    "CheckpointVersion",
    "ConfigError",
    "CorruptSaveError",
    "CorrectionStats",
    "DecoderLM",
    "ForwardInput",
    "ForwardOptions",
    "ForwardOutput",
    "GradientCommitError",
    "ImportanceCorrection",
    "LoRAAdapter",
    "LoRAConfig",
    "MemoryAdmissionError",
    "ModelConfig",
    "PlacementDecision",
    "PlannerCalibration",
    "PlannerMiss",
    "RecordReport",
    "ResolvedOptions",
    "SaveInForceError",
    "RatioStats",
    "StaleGradientError",
    "StepReport",
    "Trainer",
    "TrainerError",
    "UNSET",
    "UnsupportedSavedStateError",
    "mark_quantized_saved_state",
    "observe_planner_misses",
    "replay_estimate",
    "resolve_options",
    "token_logprobs",
]

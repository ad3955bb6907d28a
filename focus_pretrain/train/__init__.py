"""Training: the trainer and its components (checkpoints, validation, the stop agreement,
metrics), freezing policies and schedules, the dry-run memory plan."""

from focus_pretrain.checkpoint.save import Checkpointer
from focus_pretrain.config import TrainConfig
from focus_pretrain.parallel.config import ParallelConfig
from focus_pretrain.train.metrics import MetricsLogger, read_metrics
from focus_pretrain.train.stop import StopSignal
from focus_pretrain.train.trainer import Trainer, pretrain
from focus_pretrain.train.validate import Validator

__all__ = [
    "Checkpointer",
    "MetricsLogger",
    "ParallelConfig",
    "StopSignal",
    "TrainConfig",
    "Trainer",
    "Validator",
    "pretrain",
    "read_metrics",
]

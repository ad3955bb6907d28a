"""Training: configuration sections, the DeepSpeed engine and loop, checkpoints, metrics."""

from focus_pretrain.train.config import ParallelConfig, TrainConfig

__all__ = ["ParallelConfig", "TrainConfig"]

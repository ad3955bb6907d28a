"""Process groups, context parallelism for Focus, and the CPU shim for megatron-core."""

from focus_pretrain.parallel.cpu_shim import apply_cpu_shim, cpu_shim_applied

__all__ = ["apply_cpu_shim", "cpu_shim_applied"]

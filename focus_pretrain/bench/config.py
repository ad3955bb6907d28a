"""What ``tools/bench_attention.py`` measures: its options and their defaults, importable
without PyTorch (the tool's ``--help`` reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # focus_pretrain.bench.report.DTYPES' keys


@dataclass
class BenchConfig:
    """What to measure (see ``tools/bench_attention.py --help``)."""

    seq: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 65536, 262144, 1048576])
    groups: list[int] = field(default_factory=lambda: [4, 8])
    top_k: list[int] = field(default_factory=lambda: [1, 2])
    window: int = 128
    batch: int = 1
    heads: int = 16
    heads_kv: int = 16
    head_dim: int = 128
    dtype: str = "bf16"
    backends: list[str] = field(default_factory=lambda: ["decomposed", "flex"])
    warmup: int = 3
    repeats: int = 10
    train: bool = False
    hard: bool = True  # False: only the training rows (with train=True)
    train_modes: list[str] = field(default_factory=lambda: ["soft", "hard"])  # rows with train
    gate_forms: list[str] = field(default_factory=lambda: ["sigmoid"])  # the training rows' gates
    key_groups: str = "own"  # every routed row's rule of the keys' groups (focus.key_groups)
    device: str = "cuda"
    seed: int = 0
    profile: str | None = None  # append torch.profiler tables of one call per backend here
    graphs: bool = False  # time captured calls (torch.compile reduce-overhead: CUDA graphs)

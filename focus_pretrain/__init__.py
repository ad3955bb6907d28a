"""focus-pretrain: pretraining and retrofitting long-context language models with Focus attention.

Layers, inside out: ``focus`` (the method, plain PyTorch), ``model`` (megatron-core GPTModel with
Focus layers), ``parallel``, ``data``, ``train``, ``convert``. See ``docs/architecture.md``.
"""

import logging
import warnings

__version__ = "0.1.0"

# megatron-core announces at import that it falls back to its own implementations where Apex and
# Transformer Engine are absent: the fallback is what this project runs, so the notices (six
# lines per process, before every command's own output) say nothing to act on
warnings.filterwarnings(
    "ignore", message=r"(Transformer Engine and )?Apex (is|are) not installed", category=UserWarning
)
# megatron-core's TransformerConfig warns about its own default cuda_graph_scope, set or not
warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)


class _CpuAcceleratorNotice(logging.Filter):
    """Drops DeepSpeed's notice that it found no GPU (on a CPU machine: expected, every run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


logging.getLogger("DeepSpeed").addFilter(_CpuAcceleratorNotice())

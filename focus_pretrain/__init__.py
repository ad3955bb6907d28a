"""focus-pretrain: pretraining and retrofitting long-context language models with Focus attention.

Layers, inside out: ``focus`` (the method, plain PyTorch), ``model`` (megatron-core GPTModel with
Focus layers), ``parallel``, ``data``, ``train``, ``convert``. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"

"""The exports the transformers-range checks load, and the inputs they feed them.

Imports only torch: :mod:`tests.compat.test_exports` runs in environments without
``focus_pretrain`` (``tools/hf_compat.py``), where this is all it may import of ours.
"""

from __future__ import annotations

import torch

VOCAB = 128  # the vocabulary of tests/multiprocess/test_hf_import.HF_CONFIGS
PROMPT = 20
NEW_TOKENS = 24  # PROMPT + NEW_TOKENS stays within the configs' 64 positions

# export name -> (HF_CONFIGS model, Focus settings): every family, top-1 and top-2, sinks,
# Llama-3 RoPE scaling, Gemma's soft-capping and sliding-window layers, the dot gate form
CASES = {
    "llama": ("llama", dict(num_groups=4, window=3, top_k=1)),
    "gemma2-sinks": ("gemma2", dict(num_groups=4, window=3, top_k=2, sinks=2)),
    "gpt2": ("gpt2", dict(num_groups=4, window=4, top_k=1)),
    "llama3-rope-scaling": ("llama3", dict(num_groups=4, window=3, top_k=2)),
    "mistral": ("mistral", dict(num_groups=4, window=3, top_k=1)),
    "qwen2": ("qwen2", dict(num_groups=4, window=3, top_k=1)),
    "qwen3": ("qwen3", dict(num_groups=4, window=3, top_k=1, sinks=3)),
    "olmo2": ("olmo2", dict(num_groups=4, window=3, top_k=1)),
    "gemma3": ("gemma3", dict(num_groups=4, window=3, top_k=1)),
    "llama-dot-gate": ("llama", dict(num_groups=4, window=3, top_k=2, gate_form="dot")),
}


def tokens(rows: int, length: int, seed: int) -> torch.Tensor:
    """Token ids ``[rows, length]`` in ``[1, VOCAB)`` (0 is the pad id)."""
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def expected_outputs(model) -> dict[str, torch.Tensor]:
    """Hard and soft logits of two rows and 24 greedy tokens of the first (KV cache)."""
    ids = tokens(2, PROMPT, seed=1)
    focus = model.config.focus
    with torch.no_grad():
        hard = model(ids).logits
        focus["inference_mode"] = "soft"
        soft = model(ids).logits
        focus["inference_mode"] = "hard"
        greedy = model.generate(
            ids[:1], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    return {"hard": hard, "soft": soft, "greedy": greedy}

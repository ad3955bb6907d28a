"""Dequantize a GGUF causal LM into a HuggingFace directory (fp32 safetensors + tokenizer.json).

    python tools/experiments/e7/gguf_to_hf.py MODEL.gguf OUT_DIR     # needs `pip install gguf`

transformers reads the GGUF (weights dequantized to fp32, the tokenizer rebuilt from the file);
its quantizer marks the model unsaveable, so it is dropped first: the weights are plain fp32.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path, help="a new directory (an existing one is refused)")
    args = parser.parse_args()
    if not args.gguf.is_file():  # inputs first, then the output: nothing is overwritten
        parser.error(f"{args.gguf} does not exist: give a .gguf file")
    if args.out.exists() or args.out.is_symlink():
        parser.error(f"{args.out} exists: give a new directory (nothing is overwritten)")
    import torch  # heavy: after the checks
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(args.gguf.parent), args.gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # already dequantized: save as plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"{args.gguf} -> {args.out}: {sum(p.numel() for p in model.parameters()):,} parameters")


if __name__ == "__main__":
    main()

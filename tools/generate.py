"""Generate text with an exported Focus model (HF directory written by tools/convert_to_hf.py).

Prompts are batched with left padding; decoding uses the KV cache, whose one-token steps read
only each query's window and its groups' keys (hard pattern). Plain ``transformers`` does the
rest (``generate``), so every option it has works on the export from Python too.

    python tools/generate.py exports/tiny --prompt "The key of" --prompt "Once" \\
        --max-new-tokens 64                        # greedy
    python tools/generate.py exports/tiny --prompt "Once" --sample --temperature 0.8 --top-p 0.9
    python tools/generate.py exports/tiny --prompts-file prompts.txt --json out.json

``--json`` writes the prompts, completions, tokens/s and the keys read per decode step.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

from focus_pretrain.cli import tool_parser


def main(argv: list[str] | None = None) -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("export", help="exported HF directory (config.json, modeling_focus.py)")
    parser.add_argument("--prompt", action="append", default=[], help="repeat for a batch")
    parser.add_argument("--prompts-file", help="one prompt per line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--num-beams", type=int, default=1)
    parser.add_argument("--mode", choices=["hard", "soft"], help="focus inference_mode")
    parser.add_argument("--backend", help="focus inference_backend (auto, dense, decomposed...)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write prompts, completions and speed to this file")
    args = parser.parse_args(argv)

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [
            line for line in pathlib.Path(args.prompts_file).read_text().splitlines() if line
        ]
    if not prompts:
        parser.error("give at least one --prompt or a --prompts-file")
    export = pathlib.Path(args.export)
    if not (export / "config.json").is_file():
        parser.error(f"{export} has no config.json: point at a directory written by convert_to_hf")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)
    model = model.to(args.device).eval()
    if args.mode:
        model.config.focus["inference_mode"] = args.mode
    if args.backend:
        model.config.focus["inference_backend"] = args.backend
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(args.device)
    options = dict(max_new_tokens=args.max_new_tokens, num_beams=args.num_beams)
    options.update(pad_token_id=tokenizer.pad_token_id)
    if args.sample:
        options.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        options.update(do_sample=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, **options)
    seconds = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1] :]
    completions = tokenizer.batch_decode(new, skip_special_tokens=True)
    for prompt, text in zip(prompts, completions, strict=True):
        print(f"{prompt}{text}\n")
    reads = [getattr(m, "focus_keys_read", None) for m in model.modules()]
    reads = [r for r in reads if r is not None]
    result = {
        "prompts": prompts,
        "completions": completions,
        "new_tokens": int(new.numel()),
        "seconds": seconds,
        "tokens_per_second": new.numel() / seconds,
        "focus_keys_read": sum(reads),
        "focus_layers": len(reads),
    }
    print(f"{result['new_tokens']} tokens in {seconds:.2f} s ({result['tokens_per_second']:.1f}/s)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

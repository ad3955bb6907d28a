"""Generate text with an exported Focus model (HF directory written by tools/convert_to_hf.py).

Prompts are batched with left padding; decoding uses the KV cache, whose one-token steps read
only each query's window and its groups' keys (hard pattern). Plain ``transformers`` does the
rest (``generate``), so every option it has works on the export from Python too.

    python tools/generate.py exports/tiny --prompt "The key of" --prompt "Once" \\
        --max-new-tokens 64                        # greedy
    python tools/generate.py exports/tiny --prompt "Once" --sample --temperature 0.8 --top-p 0.9
    python tools/generate.py exports/tiny --prompts-file prompts.txt --json out.json

``--focus KEY=VALUE`` infers with other settings than the export's (``enabled=false``: the
original dense model; ``top_k=2``; ``window_only=true``), without exporting again.
``--json`` writes the prompts, completions, tokens/s, the keys its decode steps read (summed)
and the Focus settings inferred with. ``--cache static`` decodes on transformers' static
cache (fixed shapes: on CUDA transformers compiles the one-token step, which then visits only
the key blocks holding a key it keeps; docs/convert.md); the default is the dynamic cache.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Sequence

from focus_pretrain.cli import at_least, device, number_in, output_file, tool_parser
from focus_pretrain.errors import InputError, MissingInputError, exit_on_input_error


def main(argv: list[str] | None = None) -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("export", help="exported HF directory (config.json, modeling_focus.py)")
    parser.add_argument("--prompt", action="append", default=[], help="repeat for a batch")
    parser.add_argument("--prompts-file", help="one prompt per line")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy")
    parser.add_argument("--temperature", type=number_in(0, low_open=True), default=1.0)
    parser.add_argument("--top-p", type=number_in(0, 1, low_open=True), default=1.0)
    parser.add_argument("--num-beams", type=at_least(1), default=1)
    parser.add_argument("--mode", choices=["hard", "soft"], help="focus inference_mode")
    parser.add_argument("--backend", help="focus inference_backend (auto, dense, decomposed...)")
    parser.add_argument(
        "--focus", action="append", default=[], metavar="KEY=VALUE",
        help="infer with this Focus setting instead of the export's (repeatable): "
        "enabled=false (the original dense model), top_k=2, sinks=4, window=256, window_only=true",
    )  # fmt: skip
    parser.add_argument(
        "--cache", choices=["dynamic", "static"], default="dynamic",
        help="the KV cache: dynamic, or transformers' static one (compiled by it on CUDA)",
    )  # fmt: skip
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", type=output_file, help="write prompts, completions and speed to this file"
    )
    args = parser.parse_args(argv)
    if not args.prompt and not args.prompts_file:
        parser.error("give at least one --prompt or a --prompts-file")
    # heavy imports after the arguments: --help answers without loading PyTorch
    from focus_pretrain.convert.export_dir import export_tokenizer

    with exit_on_input_error(parser.prog):  # bad input: one line, status 2, before any loading
        prompts = read_prompts(args.prompt, args.prompts_file)
        settings = check_export(args.export, args.mode, args.backend, args.focus)
        check_json_target(args.json, args.export, args.prompts_file)
    export = pathlib.Path(args.export)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    tokenizer = export_tokenizer(export)  # tokenizer.json: no remote code
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    with exit_on_input_error(parser.prog):
        check_tokens(tokenizer, prompts)
    # at load time: enabled and window_only decide which layers get routers
    focus = {} if settings is None else {"focus": settings}
    model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, **focus)
    model = model.to(args.device).eval()
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(args.device)
    options = dict(max_new_tokens=args.max_new_tokens, num_beams=args.num_beams)
    options.update(pad_token_id=tokenizer.pad_token_id)
    if args.cache == "static":
        options.update(cache_implementation="static")
    if args.sample:
        options.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        options.update(do_sample=False)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, **options)
    seconds = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1] :]  # [b, new]: a row that ended is padded
    completions = tokenizer.batch_decode(new, skip_special_tokens=True)
    generated = generated_tokens(new, model.generation_config.eos_token_id)
    for prompt, text in zip(prompts, completions, strict=True):
        print(f"{prompt}{text}\n")
    result = _result(model, prompts, completions, generated, seconds, args.cache)
    print(f"{result['new_tokens']} tokens in {seconds:.2f} s ({result['tokens_per_second']:.1f}/s)")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


def _result(model, prompts, completions, generated: int, seconds: float, cache: str) -> dict:
    """What ``--json`` writes: prompts, completions, speed, keys read, settings, cache."""
    routed = [m for m in model.modules() if getattr(m, "router", None) is not None]
    reads = [getattr(m, "focus_keys_read", 0) for m in routed]
    result = {
        "prompts": prompts,
        "completions": completions,
        "new_tokens": generated,
        "seconds": seconds,
        "tokens_per_second": generated / seconds,
        # counted by the dynamic cache's sparse step (the static cache's compiled step does not)
        "focus_keys_read": sum(reads) if cache == "dynamic" else None,
        "focus_layers": len(routed),
        "focus": _settings(model),
        "cache": cache,
    }
    return result


def generated_tokens(new, eos: int | list[int] | None) -> int:
    """The tokens ``generate`` produced in ``new`` ``[b, n]``: per row up to and including
    its first end-of-sequence token (what follows is padding), every token without one."""
    import torch

    if eos is None:
        return int(new.numel())
    ends = torch.isin(new, torch.tensor(eos if isinstance(eos, list) else [eos]))  # [b, n]
    first = torch.where(ends.any(1), ends.int().argmax(1) + 1, new.shape[1])  # [b]
    return int(first.sum())


def check_json_target(json_path: str | None, export: str, prompts_file: str | None) -> None:
    """Refuse a ``--json`` that would overwrite an input: a file of the export, or the
    prompts file.

    Raises:
        InputError: naming the file.
    """
    if json_path is None:
        return
    target = pathlib.Path(json_path).resolve()
    if target.is_relative_to(pathlib.Path(export).resolve()):
        raise InputError(f"--json {json_path} is inside the export {export}: write it elsewhere")
    if prompts_file is not None and target == pathlib.Path(prompts_file).resolve():
        raise InputError(f"--json {json_path} is the --prompts-file: write it elsewhere")


def _settings(model) -> dict | None:
    """The Focus settings ``model`` infers with (``None``: not a Focus model)."""
    focus = getattr(model.config, "focus", None)
    return dict(focus) if isinstance(focus, dict) else None


def check_export(
    export: str, mode: str | None, backend: str | None, settings: Sequence[str] = ()
) -> dict | None:
    """The Focus section to load the export with (``None``: its own), the export's with
    ``--mode``, ``--backend``, then the ``--focus KEY=VALUE`` settings, once checked; refuse
    what is not an export with a tokenizer, settings that the export's code refuses
    (``validate_focus``, the shipped rules) or any of them on a non-Focus model."""
    from focus_pretrain.convert.export_dir import focus_overrides, read_export

    config = read_export(export, tokenizer=True, focus=bool(mode or backend or settings))
    if not (mode or backend or settings):
        return None
    options = (("mode", "inference_mode", mode), ("backend", "inference_backend", backend))
    given = {key: value for _, key, value in options if value}
    named = " ".join(f"--{option} {value}" for option, _, value in options if value)
    return focus_overrides(config["focus"], settings, given, named)


def read_prompts(prompts: list[str], prompts_file: str | None) -> list[str]:
    """The ``--prompt`` texts, then the non-empty lines of ``prompts_file``.

    Raises:
        InputError: an empty ``--prompt``, a ``prompts_file`` that is a directory or holds no
            prompt.
        MissingInputError: ``prompts_file`` does not exist.
    """
    if any(not prompt for prompt in prompts):
        raise InputError('--prompt "" is empty: give the text to continue')
    prompts = list(prompts)
    if prompts_file is not None:
        path = pathlib.Path(prompts_file)
        if not path.exists():
            raise MissingInputError(f"--prompts-file {path} does not exist: give a text file")
        if not path.is_file():
            raise InputError(f"--prompts-file {path} is a directory: give a text file")
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if not lines:
            raise InputError(f"--prompts-file {path} holds no prompt: write one prompt per line")
        prompts += lines
    return prompts


def check_tokens(tokenizer, prompts: list[str]) -> None:
    """Refuse a prompt the export's tokenizer turns into no token (nothing to continue)."""
    for prompt in prompts:
        if not tokenizer(prompt)["input_ids"]:
            raise InputError(f"--prompt {prompt!r} is no token for the export's tokenizer")


if __name__ == "__main__":
    main()

"""RULER needle-in-a-haystack tests of an exported model, through lm-evaluation-harness's own
generator (its ``ruler`` tasks), offline with the export's tokenizer.

    focus-pretrain ruler exports/gpt2-focus --lengths 512 960 --samples 20        # CPU
    focus-pretrain ruler exports/llama --tasks niah_single_1 niah_multikey_2 niah_multikey_3 \\
        --lengths 4096 8192 --device cuda --dtype bfloat16 --json ruler.json --markdown ruler.md

A length is the whole sample: the prompt lm-eval generates (a haystack with the needles, sized
with the export's tokenizer) and the task's answer budget (128 tokens for the needle tasks).
Each score is the mean string match of the needles' values (1.0: all found); --json also keeps
every sample (prompt tokens, the values, the answer, its score). --focus changes how the
export infers without exporting again: the same samples with `--focus enabled=false` score
the original dense model, with `--focus top_k=2` a denser pattern. Tasks whose generator
downloads its text (niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue,
niah_multiquery: Paul Graham essays; ruler_qa_squad, ruler_qa_hotpot) are skipped with the
reason unless --online. Needs the `eval`
extra (lm_eval, wonderwords, nltk; installed by make setup).
"""

from __future__ import annotations

import json
import pathlib

from focus_pretrain.cli import at_least, device, output_file, tool_parser
from focus_pretrain.errors import exit_on_input_error

DEFAULT_TASKS = ["niah_single_1", "niah_multikey_2"]  # focus_pretrain.eval.ruler's


def main(argv: list[str] | None = None) -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("export", help="exported HF directory (tools/convert_to_hf.py)")
    parser.add_argument("--tasks", nargs="+", default=DEFAULT_TASKS, help="RULER tasks")
    parser.add_argument(
        "--lengths", type=at_least(1), nargs="+", default=[4096], help="sample lengths"
    )
    parser.add_argument(
        "--samples", type=at_least(1), default=20, help="samples per task and length"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=at_least(1),
        help="answer tokens (default: each task's budget, 128 for the needle tasks; a needle's "
        "value needs about 10)",
    )
    parser.add_argument("--batch-size", type=at_least(1), default=1)
    parser.add_argument("--device", type=device, default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--online", action="store_true", help="let task generators download")
    parser.add_argument(
        "--focus", action="append", default=[], metavar="KEY=VALUE",
        help="infer with this Focus setting instead of the export's (repeatable): "
        "enabled=false (the original dense model), top_k=2, sinks=4, window=256, "
        "window_only=true, inference_mode=soft, inference_backend=flex (hard mode), backend (soft)",
    )  # fmt: skip
    parser.add_argument(
        "--json", type=output_file, help="write the scores, skips and every sample's record here"
    )
    parser.add_argument("--markdown", type=output_file, help="write the table here")
    args = parser.parse_args(argv)
    from focus_pretrain.eval.ruler import markdown_table, run_ruler  # heavy: after --help

    with exit_on_input_error(parser.prog):  # bad input or a missing package: one line, status 2
        result = run_ruler(
            args.export, args.tasks, args.lengths, samples=args.samples,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, device=args.device,
            dtype=args.dtype, allow_downloads=args.online, focus=args.focus,
        )  # fmt: skip
    table = markdown_table(result)
    print(table)
    for path, text in ((args.markdown, table + "\n"), (args.json, json.dumps(result, indent=1))):
        if path:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(path).write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "records"}))


if __name__ == "__main__":
    main()

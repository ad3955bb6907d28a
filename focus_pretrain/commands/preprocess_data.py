"""Tokenise corpora into Megatron indexed datasets: sharded, in parallel, resumable.

    # many inputs -> OUT/shard-NNNNN.bin/.idx + OUT/manifest.json (then data.sources: [OUT])
    focus-pretrain preprocess --input 'corpus/**/*.jsonl' --input extra.parquet \\
        --output data/web --tokenizer data/tok.model --workers 32
    focus-pretrain preprocess --input pystdlib --output data/stdlib \\
        --train-tokenizer --vocab-size 32000 --workers 8
    # one indexed dataset PREFIX.bin/.idx (small corpora; no resume)
    focus-pretrain preprocess --input demo:2000 --output-prefix data/demo \\
        --train-tokenizer --vocab-size 1024

--input (repeatable, several values each) is `demo[:N]`, `pystdlib[:N]`, a .jsonl/.json/
.parquet/.txt file, a glob or a directory of them (recursive), a `datasets` save_to_disk
directory or a hub dataset name. With --output, shard k holds records [k D, (k+1) D) (D =
--shard-documents) whatever --workers is; rerunning an interrupted command resumes it (finished
shards are kept; other inputs or settings, --vocab-size included, are refused, or start again
while no shard is finished, --overwrite always). Bad records (invalid JSON or UTF-8, a missing
--text-key field, empty files) stop the run with the file and line, or with --skip-bad-records
are skipped and counted; adding --skip-bad-records to a stopped command resumes it. With
--train-tokenizer a SentencePiece model (Llama-style options) is trained first on up to 100,000
documents spread over the inputs: OUT/tokenizer.model (or PREFIX.model). Prints tokens/s and a
JSON line of stats last (also written to OUT/stats.json, or --stats). Each document ends with
the tokenizer's end-of-document id and begins, by --add-bos, with what the tokenizer's own
encoding puts first (auto: a BOS for Gemma or Llama 3 tokenizers, nothing for a SentencePiece
model), its BOS (true) or nothing (false); training's data.add_bos is the same setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

from focus_pretrain.cli import at_least, output_file, tool_parser
from focus_pretrain.data.corpus import (
    ReadOptions,
    RecordCounts,
    check_sizes,
    index_inputs,
    read_all,
    resolve_inputs,
)
from focus_pretrain.data.preprocess import say_phase, tokenize_to_indexed
from focus_pretrain.data.shards import SHARD_DOCUMENTS, preprocess_corpus, train_corpus_tokenizer
from focus_pretrain.data.tokenizer import check_tokenizer_path, check_vocab_size
from focus_pretrain.errors import InputError, exit_on_input_error


def _parser() -> argparse.ArgumentParser:
    parser = tool_parser(__doc__)
    parser.add_argument("--input", action="append", nargs="+", required=True, metavar="SOURCE")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--output", help="a directory of shards and manifest.json")
    where.add_argument("--output-prefix", help="one indexed dataset PREFIX.bin/.idx")
    parser.add_argument("--tokenizer", help="an existing SentencePiece .model (or HF directory)")
    parser.add_argument("--train-tokenizer", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument(
        "--add-bos",
        type=_add_bos,
        default="auto",
        metavar="{auto,true,false}",
        help="what each document begins with (default auto: as the tokenizer encodes a text)",
    )
    parser.add_argument("--text-key", default="text", help="the field holding the text")
    parser.add_argument("--split", default="train", help="split of a datasets dataset")
    parser.add_argument("--workers", type=at_least(1), default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--shard-documents", type=at_least(1), default=SHARD_DOCUMENTS)
    parser.add_argument("--skip-bad-records", action="store_true")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start a sharded run again (its own files only), or replace an existing "
        "PREFIX.bin/.idx (and PREFIX.model with --train-tokenizer)",
    )
    parser.add_argument("--seed", type=int, default=0, help="demo corpus seed")
    parser.add_argument("--stats", type=output_file, help="also write the stats JSON here")
    return parser


def _add_bos(value: str) -> bool | str:
    """``--add-bos``'s value as ``data.add_bos`` takes it."""
    choices = {"auto": "auto", "true": True, "false": False}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"{value!r}: use auto, true or false")
    return choices[value.lower()]


def _single_file(args: argparse.Namespace, inputs: list[str], options: ReadOptions) -> dict:
    """The ``--output-prefix`` mode: one ``PREFIX.bin``/``PREFIX.idx``."""
    started = time.perf_counter()
    suffixes = [".bin", ".idx", *([".model", ".vocab"] if args.train_tokenizer else [])]
    existing = [f"{args.output_prefix}{s}" for s in suffixes]
    existing = [path for path in existing if Path(path).exists()]
    if existing and not args.overwrite:  # a dataset (or tokenizer) there is never replaced silently
        raise InputError(
            f"{', '.join(existing)} exist: pass --overwrite to replace them, or choose another "
            "--output-prefix"
        )
    units = resolve_inputs(inputs)
    if args.train_tokenizer:
        check_vocab_size(args.vocab_size)
    else:
        check_tokenizer_path(args.tokenizer)
    check_sizes(units, options)
    say_phase(f"indexing {len(units)} input(s) ...")
    indexes = index_inputs(units, options)
    tokenizer = args.tokenizer
    if args.train_tokenizer:
        prefix = Path(args.output_prefix)
        say_phase(f"training a SentencePiece tokenizer ({args.vocab_size:,} pieces)")
        tokenizer = train_corpus_tokenizer(units, indexes, options, prefix, args.vocab_size)
        print(f"tokenizer: {tokenizer}")
    counts = RecordCounts()
    stats: dict[str, Any] = tokenize_to_indexed(
        read_all(units, indexes, options, counts),
        tokenizer,
        args.output_prefix,
        workers=args.workers,
        total=sum(i["records"] for i in indexes),
        add_bos=args.add_bos,
    )
    for index in indexes:  # whole files left out
        if index["problem"]:
            counts.skipped[index["problem"][0]] += 1
    seconds = time.perf_counter() - started
    stats.update(skipped=dict(counts.skipped), skipped_total=sum(counts.skipped.values()))
    stats.update(blank_lines=counts.blank_lines, skipped_examples=counts.examples)
    stats.update(seconds=round(seconds, 3), tokens_per_s=round(stats["tokens"] / seconds, 1))
    return {"output_prefix": args.output_prefix, "tokenizer": str(tokenizer), **stats}


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if bool(args.tokenizer) == args.train_tokenizer:
        parser.error("give exactly one of --tokenizer MODEL or --train-tokenizer")
    inputs = [value for group in args.input for value in group]
    options = ReadOptions(args.text_key, args.skip_bad_records, args.seed, args.split)
    with exit_on_input_error(parser.prog):  # bad input (a bad record too): one line, status 2
        if args.output_prefix:
            stats = _single_file(args, inputs, options)
        else:
            stats = preprocess_corpus(
                inputs,
                args.output,
                args.tokenizer,
                vocab_size=args.vocab_size,
                workers=args.workers,
                shard_documents=args.shard_documents,
                options=options,
                overwrite=args.overwrite,
                add_bos=args.add_bos,
            )
    if args.output and stats["shards_reused"]:
        print(f"resumed: {stats['shards_reused']} of {stats['shards']} shards were already done")
    rate = f"{stats['tokens_per_s']:,.0f} tokens/s"
    if "tokens_per_s_per_worker" in stats:
        rate += f" ({stats['tokens_per_s_per_worker']:,.0f} per busy worker)"
    print(f"{stats['documents']:,} documents, {stats['tokens']:,} tokens; {rate}")
    if args.output:  # what to do with it
        sources = shlex.quote(f'data.sources=["{args.output}"]')
        tokenizer = shlex.quote(f"data.tokenizer={stats['tokenizer']}")
        print(f"train on it: --set {sources} --set {tokenizer}")
    if stats["skipped_total"]:
        kinds = ", ".join(f"{k}: {n}" for k, n in stats["skipped"].items())
        print(f"skipped {stats['skipped_total']} bad records ({kinds}), e.g.")
        print("\n".join(f"  {m}" for m in stats["skipped_examples"][:3]))
    if args.stats:
        Path(args.stats).parent.mkdir(parents=True, exist_ok=True)
        Path(args.stats).write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats))


if __name__ == "__main__":
    main()

"""Tokenise a corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input demo:2000 --output-prefix data/demo \\
        --train-tokenizer --vocab-size 1024
    python tools/preprocess_data.py --input corpus/*.jsonl --output-prefix data/web \\
        --tokenizer data/demo.model --workers 8

--input is `demo[:N]`, a local .jsonl/.json/.parquet/.txt file, glob or directory, or a hub
dataset name. With --train-tokenizer a SentencePiece model (Llama-style options) is trained on
the same corpus first and written to PREFIX.model.
"""

from __future__ import annotations

import argparse
import json
import os

from focus_pretrain.data import load_texts, tokenize_to_indexed, train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer", help="an existing SentencePiece .model")
    parser.add_argument("--train-tokenizer", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--seed", type=int, default=0, help="demo corpus seed")
    args = parser.parse_args()
    if bool(args.tokenizer) == args.train_tokenizer:
        parser.error("give exactly one of --tokenizer MODEL or --train-tokenizer")

    texts = load_texts(args.input, text_key=args.text_key, seed=args.seed)
    tokenizer = args.tokenizer
    if args.train_tokenizer:
        tokenizer = train_tokenizer(texts["text"], args.output_prefix, args.vocab_size)
        print(f"tokenizer: {tokenizer}")
    stats = tokenize_to_indexed(
        texts["text"], tokenizer, args.output_prefix, workers=args.workers, total=len(texts)
    )
    print(json.dumps({"output_prefix": args.output_prefix, "tokenizer": str(tokenizer), **stats}))


if __name__ == "__main__":
    main()

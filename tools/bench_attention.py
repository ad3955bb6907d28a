"""``focus-pretrain bench`` as a script (``python tools/bench_attention.py``): the
command lives in :mod:`focus_pretrain.commands.bench_attention` (its options: ``--help``)."""

from focus_pretrain.commands.bench_attention import main

if __name__ == "__main__":
    main()

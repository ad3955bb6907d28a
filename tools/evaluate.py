"""``focus-pretrain evaluate`` as a script (``python tools/evaluate.py``): the
command lives in :mod:`focus_pretrain.commands.evaluate` (its options: ``--help``)."""

from focus_pretrain.commands.evaluate import main

if __name__ == "__main__":
    main()

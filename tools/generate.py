"""``focus-pretrain generate`` as a script (``python tools/generate.py``): the
command lives in :mod:`focus_pretrain.commands.generate` (its options: ``--help``)."""

from focus_pretrain.commands.generate import main

if __name__ == "__main__":
    main()

"""``focus-pretrain preprocess`` as a script (``python tools/preprocess_data.py``): the
command lives in :mod:`focus_pretrain.commands.preprocess_data` (its options: ``--help``)."""

from focus_pretrain.commands.preprocess_data import main

if __name__ == "__main__":
    main()

"""``focus-pretrain import-hf`` as a script (``python tools/import_hf.py``): the
command lives in :mod:`focus_pretrain.commands.import_hf` (its options: ``--help``)."""

from focus_pretrain.commands.import_hf import main

if __name__ == "__main__":
    main()

"""``focus-pretrain export`` as a script (``python tools/convert_to_hf.py``): the
command lives in :mod:`focus_pretrain.commands.convert_to_hf` (its options: ``--help``)."""

from focus_pretrain.commands.convert_to_hf import main

if __name__ == "__main__":
    main()

"""``focus-pretrain retrofit`` as a script (``python tools/retrofit.py``): the
command lives in :mod:`focus_pretrain.commands.retrofit` (its options: ``--help``)."""

from focus_pretrain.commands.retrofit import main

if __name__ == "__main__":
    main()

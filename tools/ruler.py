"""``focus-pretrain ruler`` as a script (``python tools/ruler.py``): the
command lives in :mod:`focus_pretrain.commands.ruler` (its options: ``--help``)."""

from focus_pretrain.commands.ruler import main

if __name__ == "__main__":
    main()

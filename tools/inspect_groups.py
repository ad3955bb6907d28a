"""``focus-pretrain inspect`` as a script (``python tools/inspect_groups.py``): the
command lives in :mod:`focus_pretrain.commands.inspect_groups` (its options: ``--help``)."""

from focus_pretrain.commands.inspect_groups import main

if __name__ == "__main__":
    main()

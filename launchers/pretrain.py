"""``focus-pretrain train`` as a script: ``python launchers/pretrain.py``,
``deepspeed launchers/pretrain.py``, ``torchrun ... launchers/pretrain.py``. The command lives in
:mod:`focus_pretrain.commands.pretrain` (its options: ``--help``)."""

from focus_pretrain.commands.pretrain import main

if __name__ == "__main__":
    main()

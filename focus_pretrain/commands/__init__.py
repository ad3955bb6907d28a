"""The ``focus-pretrain`` subcommands, one module each with a ``main()`` that reads
``sys.argv`` (:mod:`focus_pretrain.cli` runs them; the scripts in ``launchers/`` and ``tools/``
are thin wrappers around the same ``main``). Inside the package, so that the command works from
a wheel as well as from a source checkout."""

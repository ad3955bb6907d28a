"""Files on disk that must not be lost: atomic and durable writes, the run directory's lock,
outputs replaced only when they are ours, checkpoint folders verified, checkpoint files read
without running pickled code.

A leaf part (it imports only :mod:`focus_pretrain.errors`): ``train/``, ``convert/``, the
tools and the analysis all use it.
"""

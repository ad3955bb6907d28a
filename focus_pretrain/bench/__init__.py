"""Benchmarks (``tools/bench_attention.py``): timing code kept out of the method package."""

"""Benchmarks that run scaleout and its peers side by side, interleaved, in one run."""

"""Benchmarks: scripts that print ratios measured side by side (`python -m benchmarks.X`).

They are not timed unit tests; `tests/test_benchmarks.py` checks only the parts that do
not depend on the machine (the compile count and the bit accounting).
"""

"""Reliability suite (issue 8): nothing lost under load, faults and hostile input.

Run it whole with `tools/reliability.py` (a report at the end); `pytest tests/reliability`
runs the fast subset, `-m "slow or not slow"` everything.
"""

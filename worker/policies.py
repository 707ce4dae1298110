"""The worker's loss policies (worker/rto.py describes them); the first is the default.

Standard library only: p4/harness/mininet_thc.py imports it under Debian's python3.
"""

POLICIES = ("retransmit", "zero")

"""The one description both P4 programs are generated from, and that their control plane reads.

p4/gen_p4.py writes these into p4/thc.p4 (v1model) and p4/tofino/thc_tna.p4 (TNA) as P4
constants; p4/control.py reads the switch's event counters by the same list.  The THC header
and its constants come from proto/headers.py, as everywhere else.
"""
from __future__ import annotations

LANES = 32           # 4-bit indices per DATA packet, 8-bit sums per RESULT
SLOTS = 1024         # slots (data + norm) of the v1model program; each has two lane banks
MAX_JOBS = 8         # jobs the switch holds at once: each has a region of the slots (p4/control.py)
MAX_RANKS = 32       # ranks per job (the 32-bit contributor bitmap)
PORT = 9000          # the UDP port the workers send to

#: The switch's event counters, in counter-index order.  The drop reasons use the software
#: PS's names (ps_server/reference.py DROP_REASONS); the others its counter names.
EVENTS = ("malformed", "wrong_version", "unknown_job", "slot_out_of_range", "worker_out_of_range",
          "unregistered", "stale", "duplicate", "late", "rounds_completed", "partial_rounds",
          "results_resent", "ahead")
#: The drop reasons among EVENTS.
DROPS = ("malformed", "wrong_version", "unknown_job", "slot_out_of_range", "worker_out_of_range",
         "unregistered", "stale", "duplicate", "late", "ahead")
#: Counter cells per block (room for more events).  The programs' counter array holds
#: MAX_JOBS + 1 blocks: block 0 counts what no job owns, block k the job in job cell k.
EVENT_CELLS = 16

#: Outcomes of the slot update, as the software PS decides them (docs/design.md, PS rules).
VERDICTS = ("DROP_MALFORMED", "AGG", "AGG_DONE", "RESEND_CUR", "DUP", "LATE", "RESEND_PREV",
            "STALE", "AHEAD", "NO_JOB")

assert set(DROPS) <= set(EVENTS) and len(EVENTS) <= EVENT_CELLS


def event_constant(name: str) -> str:
    """The P4 constant naming an event's counter index: `rounds_completed` → C_ROUNDS_COMPLETED."""
    return "C_" + name.upper()

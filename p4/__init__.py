"""THC-PS's switch program and its control plane.

`p4` is also the top-level package of the P4Runtime bindings on PyPI (`p4runtime`:
`p4.v1`, `p4.config.v1`).  Both can be imported together: this package extends its path
with every other `p4` directory on sys.path (pkgutil-style), so whichever `p4` is found
first, `p4.v1` resolves.  The project imports this package as thc_ps.p4; the path extension
matters where a checkout's root is on sys.path, so that its p4/ folder is found as a
top-level `p4` before P4Runtime's.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

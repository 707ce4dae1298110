"""THC-PS's switch program and its control plane.

`p4` is also the top-level package of the P4Runtime bindings on PyPI (`p4runtime`:
`p4.v1`, `p4.config.v1`).  Both can be imported together: this package extends its path
with every other `p4` directory on sys.path (pkgutil-style), so whichever `p4` is found
first, `p4.control` and `p4.v1` both resolve.
"""
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

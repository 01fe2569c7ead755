"""The packed-weight format, side by side: linears computed from the CPU
kernel library's own packed copy of their weight (oneDNN, MKL), made once,
checked against the parameter on every call and made again when it changed.

Where each piece is (the pipeline entry is ``wfpass/prepack/format.py``,
which runs these steps):

=====================  ========================================================
``match.py``           matcher: single linears, the one-GEMM blocks of
                       ``fuse_linears``, and its split-path groups (packed as
                       their block)
``guards.py``          whether a call is packed, and the kernel for a static
                       row count
``choose.py``          the kernel per shape and row count, measured once per
                       process: oneDNN's or MKL's packed kernel, or the plain
                       GEMM
``rewrite.py``         the graph's new call, ``wfpass::packed_linear``, and
                       its site (record, options, kernel per row count)
``kernel.py``          the op: its packed copies (owned by the parameter),
                       the per-call check, its fake and its gradient formula
=====================  ========================================================
"""

"""The sibling-linear format, side by side: linears that read the same input
(Q/K/V, gate/up) computed from one weight block, with one GEMM where that
pays.

Where each piece is (the pipeline entry is ``wfpass/linear/format.py``,
which runs these steps):

=====================  ========================================================
``site.py``            one linear call as both linear formats see it
                       (``linear_sites``, ``weight_block_of``) and the
                       refusals about its own tensors they share
``match.py``           matcher: the linear calls of a graph, grouped by their
                       input
``guards.py``          which members are left out, whether the rest is fused,
                       and on which path (one GEMM, or one per member)
``rewrite.py``         the rewrite: the block, its per-call layout check, the
                       graph's new call
``kernel.py``          the block's layout (``LinearLayout``) and the kernel
                       (``fused_linear``, whose backward is written in ATen ops)
``group.py``           ``wfpass::linear_group``: the siblings of an exported
                       program as one op over each weight where it is
                       (``deploy/linear.py`` puts it in the program)
``already_fused.py``   layers that already hold several projections in one
                       weight (``nn.MultiheadAttention``, GPT-2's ``Conv1D``):
                       reported, left alone
=====================  ========================================================
"""

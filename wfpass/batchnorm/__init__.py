"""The BatchNorm formats, side by side: BatchNorm tensors held in fp32 in
half-precision models (``fp32_batchnorm``), and eval-mode BatchNorm folded
into the conv/linear in front of it (``fold_batchnorm``, opt-in).

Where each piece is (the pipeline entries are ``wfpass/batchnorm/fp32_format.py``
and ``wfpass/batchnorm/fold_format.py``, which run these steps):

===============  ===============================================================
``match.py``     matcher both formats use: every batch norm of a graph, in any
                 flavour (``BNSite``), looking through the fp32 wrappers
``fp32.py``      fp32 format, the graph's batch norms: why one is left alone
                 (``call_problem``), the rewrite per flavour (``rewrite_call``)
``eager.py``     fp32 format, the BatchNorms Dynamo runs eagerly
                 (``momentum=None`` in training): their matches, guard, move,
                 pre-hook and row, also for a graph of their own forward; the
                 note naming a BatchNorm that stopped a compile
``fold.py``      fold format: why a batch norm is not folded (``refusal``), the
                 rewrite (``fold``)
``kernels.py``   the fp32 move and its undo, the per-call check of
                 ``wfpass.apply`` graphs (``bn_fp32``, ``bn_module_fp32``), the
                 fold kernels (``folded_params``, ``fold_weight``, ``fold_bias``)
===============  ===============================================================
"""

"""The RNN format: ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` calls and Python
loops of their cells, with every weight in one flat block and a call the
compiler sees whole.

Where each piece is (the pipeline entries are ``wfpass/rnn/format.py``
and ``wfpass/rnn/cells/format.py``, which run these steps). The format
itself, here:

================================  =====================================================
``spec.py``                       ``RnnSpec``: the static facts of one RNN, names, zero state
``capture.py``                    what happens when Dynamo captures an RNN: its errors name it
``eager_calls.py``                the calls of a captured RNN that ran eagerly inside a
                                  compiled function, counted on its row with why
``match.py``                      matcher: RNN calls in Dynamo and ``symbolic_trace`` graphs
``guards.py``                     guards and layout: why a call is left alone, or its spec
                                  (the offsets of its weights in the flat block)
``format.py``                     the pipeline's step: match, guard, rewrite (``FuseRnn``)
``plan.py``                       which kernel a call takes, decided once: ``RnnPlan``,
                                  read by the rewrite, the report row and ``explain``
``rewrite.py``                    the rewrite: the group and its block, the graph's new call
``paths.py``                      the kernels' paths: ``fused`` / ``loop`` / ``mkldnn`` /
                                  ``native`` / ``aten``, ``RnnForward``
``auto.py``                       ``seq_threshold="auto"``: the paths timed once per shape
``eager.py``                      the calls of ``wfpass.apply`` graphs, which run eagerly:
                                  ``RnnModuleCall``, ``CellLoopCall``
``ops.py``                        ``define_rnn_op``: an op, its autograd-free twin and its
                                  backward, with kernels and fakes (how ``cpu/`` and
                                  ``cuda/`` define their ops)
================================  =====================================================

and its sub-packages:

=============  ==========================================================================
``cells/``     cell loops folded into one RNN call: ``format.py``, ``match.py``,
               ``guards.py``, ``rewrite.py``
``varlen/``    variable-length batches: ``pack_padded_sequence`` -> RNN ->
               ``pad_packed_sequence`` as ops Dynamo puts into the graph
               (``sequence.py``, ``pad_ops.py``), a batch's size while it is traced (``meta.py``)
``cpu/``       the CPU kernels: oneDNN's LSTM layer (its prepacked weights:
               ``lstm_prepack.py``), ATen's GRU / RNN layer, the layer loop over a
               variable-length batch (``varlen_layer*.py``: C++, with its Python twins)
               and oneDNN over its runs (``varlen_lstm_runs.py``)
``cuda/``      the CUDA kernels: cuDNN's whole RNN, its variable-length mode, the
               weights' gradients as views of cuDNN's gradient buffer
=============  ==========================================================================

The kernels know of the format only ``ops.define_rnn_op`` and
``varlen.meta``: nothing in ``cpu/`` or ``cuda/`` imports the matcher,
guards, rewrite or capture (``tests/test_architecture.py`` checks). Importing
this package, or any of its sub-packages, imports none of their modules.

The flat block: every Parameter of the RNN is a view into one buffer (same
objects), in PyTorch's ``_flat_weights`` order on the CPU and in cuDNN's
layout on CUDA (every layer's matrices, then the biases). The CPU kernels read each
weight by itself, so the graph passes the parameters, not the block, and a
lost layout never changes a result (the backend re-fuses it, counted).
"""

"""The RNN format, side by side: ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` calls
and Python loops of their cells, with every weight in one flat block and a
call the compiler sees whole.

Where each piece is (the pipeline entries are ``wfpass/passes/fuse_rnn.py``
and ``wfpass/passes/fold_cells.py``, which run these steps):

================================  =====================================================
``spec.py``                       ``RnnSpec``: the static facts of one RNN, names, zero state
``capture.py``                    what happens when Dynamo captures an RNN: its errors name it
``match.py``                      matcher: RNN calls in Dynamo and ``symbolic_trace`` graphs
``guards.py``                     guards and layout: why a call is left alone, or its spec
                                  (the offsets of its weights in the flat block)
``rewrite.py``                    the rewrite: the group and its block, the graph's new call
``paths.py``                      the kernels: ``fused`` / ``loop`` / ``mkldnn`` / ``native`` /
                                  ``aten`` paths, which one a call takes, ``RnnForward``
``ops.py``                        ``define_rnn_op``: an op, its autograd-free twin and its
                                  backward, with kernels and fakes (the three ops below)
``lstm_layer.py``                 the ``wfpass::lstm_layer`` op (oneDNN's LSTM layer, trainable
                                  under AOTAutograd)
``native_layer.py``               the ``wfpass::rnn_layer`` op (ATen's GRU / plain RNN kernel as
                                  one op, with a backward that handles all steps at once)
``cudnn.py``                      the ``wfpass::cudnn_rnn`` op (cuDNN's whole RNN, on CUDA)
``packed.py``                     variable-length batches: ``pack_padded_sequence`` -> RNN ->
                                  ``pad_packed_sequence`` as ops Dynamo puts into the graph
``packed_meta.py``                a packed batch's number of sequences while it is traced
``packed_layer.py``               the ``wfpass::packed_layer`` op (one layer and direction over a
                                  packed batch: a C++ loop over each sequence's valid steps)
``packed_layer_py.py``            its Python forward kernel (the bits of the C++ one's ATen loop;
                                  ``WFPASS_NATIVE=0``) and the mode tables and checks the op
                                  shares with it
``packed_layer_py_backward.py``   its Python backward kernel
``packed_lstm_runs.py``           the ``wfpass::packed_lstm_runs`` op (a packed LSTM layer without
                                  grad as oneDNN's LSTM layer over each run of equal batch size)
``cudnn_packed.py``               the ``wfpass::cudnn_packed_rnn`` op (cuDNN's packed mode)
``cudnn_grads.py``                the weights' gradients as views of cuDNN's gradient buffer
``auto.py``                       ``seq_threshold="auto"``: the paths timed once per shape
``eager.py``                      the calls of ``wfpass.apply`` graphs, which run eagerly:
                                  ``RnnModuleCall``, ``CellLoopCall``
``cells_match.py``                cell loops: steps, chains of steps, stacked layers
``cells_guards.py``               why a loop is not folded
``cells_rewrite.py``              a loop replaced by one RNN call
================================  =====================================================

The flat block: every Parameter of the RNN is a view into one buffer (same
objects), in PyTorch's ``_flat_weights`` order on the CPU and in cuDNN's
layout on CUDA (every layer's matrices, then the biases). The CPU kernels read each
weight by itself, so the graph passes the parameters, not the block, and a
lost layout never changes a result (the backend re-fuses it, counted).
"""

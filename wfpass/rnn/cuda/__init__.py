"""The RNN format's CUDA kernels: ``cudnn.py`` (the ``wfpass::cudnn_rnn``
op, cuDNN's whole multi-layer RNN read from the model's flat weight
buffer), ``cudnn_packed.py`` (``wfpass::cudnn_packed_rnn``, cuDNN's packed
mode, for variable-length batches) and ``cudnn_grads.py`` (the weights'
gradients as views of cuDNN's gradient buffer, no copy per training step).
Each op, with its fake and its gradient, is registered when its module is
imported; importing the package imports none of them.
"""

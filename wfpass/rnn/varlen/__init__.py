"""Variable-length batches: ``pack_padded_sequence`` -> ``nn.LSTM/GRU/RNN``
-> ``pad_packed_sequence`` as ops Dynamo puts into the graph for wformat
backends. ``sequence.py`` has the ops (``wfpass::pack_padded``,
``pad_packed``, ``packed_zero_state``, ``packed_rnn``, with their fakes and
gradients), the packed RNN's graph call (``PackedRnnForward``) and its
choice of kernel (``packed_path``), and the functions Dynamo traces instead
of torch's (a captured RNN's ``forward`` among them); ``meta.py`` a packed
batch's number of sequences while it is traced, which the kernels' fakes in
``cpu/`` and ``cuda/`` read too. The kernels themselves are there.
"""

"""The RNN format's CPU kernels: ``lstm_layer.py`` (the
``wfpass::lstm_layer`` op, oneDNN's LSTM layer, trainable under
AOTAutograd), ``native_layer.py`` (``wfpass::rnn_layer``, ATen's GRU /
plain RNN kernel as one op, with a backward that handles all steps at once;
its C++ loop in ``native/rnn/rnn.cpp``), ``packed_layer.py``
(``wfpass::packed_layer`` and ``packed_bilayer``, one layer over a packed
batch: a C++ loop over each sequence's valid steps, in
``native/rnn/varlen_rnn.cpp``) with its Python twins
``packed_layer_py.py`` (the forward, and the mode tables and checks the op
shares with it) and ``packed_layer_py_backward.py``, and
``packed_lstm_runs.py`` (``wfpass::packed_lstm_runs``, a packed LSTM layer
without grad as oneDNN's LSTM layer over each run of equal batch size).
Each op, with its fake and its gradient, is registered when its module is
imported; importing the package imports none of them.
"""

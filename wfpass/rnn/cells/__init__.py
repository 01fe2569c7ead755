"""Cell loops: a Python loop of ``nn.LSTMCell`` / ``nn.GRUCell`` /
``nn.RNNCell`` steps folded into one RNN call, which ``fuse_rnn`` then
lowers as it lowers an ``nn.LSTM``; the steps the ``fold_cells`` pipeline
entry (``wfpass/rnn/cells/format.py``) runs: ``match.py`` finds every cell
step, chains of steps of one cell and chains stacked into layers;
``guards.py`` says why a loop is not folded (the RNN format's own guards
asked of a trial call included); ``rewrite.py`` replaces a loop by one RNN
call, or by a ``CellLoopCall`` in ``symbolic_trace`` graphs.
"""

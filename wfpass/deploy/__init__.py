"""Exported programs: ``wfpass.export`` (``program.py``) and the RNN ops it
traces (``rnn.py``). See docs/guide/export.md."""

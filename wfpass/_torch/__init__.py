"""The only place wfpass touches private PyTorch API, split by subsystem:
``dynamo`` (graph inputs' sources, the frame being compiled, the config
values that ask wfpass while Dynamo traces), ``aot`` (AOTAutograd and
Inductor), ``distributed`` (FSDP2, DDP), ``kernels`` (ATen RNN kernels,
oneDNN, cuDNN, linear, conv, BatchNorm), ``tensors`` (storage internals).
Checked on torch 2.11.0-2.15.0 (`versions.py`); each helper names the private API it needs, so a
torch upgrade breaks here, loudly, and nowhere else.

This layer imports nothing from wfpass: where Dynamo must ask wfpass a
question, wfpass installs a function here (``wfpass.capture``).
"""

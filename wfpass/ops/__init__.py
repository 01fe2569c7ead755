"""Runtime kernels, one file per format."""

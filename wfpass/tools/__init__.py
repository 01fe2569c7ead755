"""What ``python -m wfpass`` runs, beside the library: the command line
(``cli``), the demo, ``doctor``, and the benchmark (``bench`` with its
cases, models, timing and report). Nothing in the library imports these;
benchmarks/ and the tests use their public helpers (``bench.own_code``,
``bench_models``)."""

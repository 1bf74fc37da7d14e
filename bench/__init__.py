"""The benchmarks (``kvstore bench MODE``), installed as ``kvstore.bench``.

One package per mode: ``tiers``, ``e2e``, ``agent``, ``faults``, ``copy`` (with the GPU checks),
``route``, ``node``, ``soak``; each is a module with ``add_args(parser)`` and ``run(args)``
(bench/common/harness.py) and runs as ``python -m kvstore.bench.MODE`` too. What two or more modes
share lives in ``common``; ``micro/`` holds the pytest micro-benchmarks (``make microbench``) and
``results/`` the measured runs.
"""

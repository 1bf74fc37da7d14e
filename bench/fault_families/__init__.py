"""The fault families of ``kvstore bench faults`` (bench/faults.py), one module each."""

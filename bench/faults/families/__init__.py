"""The fault families of ``kvstore bench faults`` (bench/faults/), one module each."""

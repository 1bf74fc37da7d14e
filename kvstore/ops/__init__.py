"""Operator commands: the CLI, ``stats``, ``inspect``, ``explain``."""

"""Backends: applying plans with torch_xla SPMD and reading what XLA compiled (only here is torch_xla imported)."""

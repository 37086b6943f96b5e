"""Subcommands of the `tritonlm` CLI that drive the server and tools."""

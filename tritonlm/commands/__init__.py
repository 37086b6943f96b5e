"""The subcommands of the `tritonlm` CLI, one module each (tritonlm/cli.py lists them). The
only place a subcommand is registered: the packages they drive stay plain libraries."""

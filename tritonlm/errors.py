"""Errors a user can act on."""


class CliError(RuntimeError):
    """Printed by the CLI as one line `error: ...`, exit code 1."""

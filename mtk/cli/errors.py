"""Errors a subcommand raises for bad input: printed as one line with a non-zero exit."""


class UserError(Exception):
    """Bad input from the user: ``mtk <command>: error: <message>``, exit status 2."""

"""Errors a user can cause and fix: shown as one line, never as a traceback."""


class UserError(Exception):
    """A mistake in what the user gave us (path, checkpoint, flag).

    The message must name the file, tensor or flag at fault. Entry points print
    ``error: <message>`` and exit with status 2.
    """

    exit_code = 2

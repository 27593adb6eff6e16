"""The one exception type the command line reports as a one-line user error."""


class UserError(ValueError):
    """Bad input from the user: the message names the value and the fix."""

"""User-facing errors: one exception type whose message says what to do."""


class DFlashError(ValueError):
    """Bad input or an impossible request, explained in words a user can act on."""

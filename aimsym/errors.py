"""User-facing errors: one line naming the field and what is allowed."""


class AimsymError(ValueError):
    """Bad input from a user. ``str(err)`` is a single line fit for a terminal.

    ``field`` names the offending input (a TOML key, a CLI option, an argument name).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # (raised in a worker process, it must arrive intact in the client)
        return self.__class__, (self.field, self.message)


class SpecError(AimsymError):
    """Invalid architecture declaration (TOML file or Python spec)."""


class ChannelError(AimsymError):
    """Denoiser input off the model's output manifold or otherwise unusable."""


class AimsymWarning(UserWarning):
    """A result that may mislead if unnoticed; the CLI prints it as one ``aimsym: warning:`` line."""


class ConvergenceWarning(AimsymWarning, RuntimeWarning):
    """An iteration (SE, AMP) stopped at its iteration limit before meeting its tolerance."""

"""The exceptions Cleave raises. Each message says what was expected, what arrived, and where."""


class CleaveError(Exception):
    """Base class of every error Cleave reports to a user."""


class UnsupportedModelError(CleaveError):
    """The model cannot be partitioned: names the operator and the reason."""


class BundleError(CleaveError):
    """A bundle on disk is missing, corrupted, or from a newer version: names the file."""


class UsageError(CleaveError):
    """The command line or a request is malformed."""

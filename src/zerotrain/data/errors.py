"""The one exception for data a user gave that cannot be used."""


class DataError(ValueError):
    """A user-caused data problem (missing, empty, unreadable, too little); the message
    names what and how to fix it."""

"""The error raised for unusable data files, columns or rows."""


class DatasetError(ValueError):
    """A data file, column or row cannot be used: the message names the file, column or row and the fix."""

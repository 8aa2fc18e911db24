"""The one exception type of the data package.

Every bad input (missing or damaged files, impossible batch geometry, unknown tokenizer, a
quarantine that leaves nothing to read) raises `DatasetError` with a single line that names the
file or key at fault and says what to do. The CLI prints it as `error: ...` and exits 2.
"""


class DatasetError(ValueError):
    """A dataset, its files or a data-order request is unusable; the message says why and how to fix it."""

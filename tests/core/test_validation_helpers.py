"""The raw-file builder, under the name some test modules import it by."""
from helpers import raw_file  # noqa: F401

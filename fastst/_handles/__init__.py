"""Handles on one file: ``handle`` (NumpyHandle, FrameworkHandle and what they share),
NumPy indexing of a lazy tensor (``slicing``), reading ahead within a byte budget
(``readahead``, ``prefetch``), and editing a file's metadata in place (``edit``)."""

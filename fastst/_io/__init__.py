"""Where the bytes are: the `Source` seam over local files, buffers, file objects and
URLs (``source``), the transports that read a URL by byte ranges (``transports``,
``http``, ``fsspec``, ``fileobj``, over ``ranged``), uploads (``upload``), atomic
replacement of files (``files``), and the bounds and knobs they share (``limits``)."""

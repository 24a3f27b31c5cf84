"""The format's facts above the compiled core: the boxes and byte runs of a tensor's
parts (``blocks``), header codes and torch dtypes (``torch_dtypes``), the checksum
format (``checksums``), the reference's low-level API (``lowlevel``) and the sharded
checkpoint's ``*.index.json`` (``index``)."""

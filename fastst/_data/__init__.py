"""The thread Loader behind ``fastst.data``: which rows each batch takes (``rowblocks``,
``order``: spans, shuffles, shards), the threads that gather them (``pipeline``) and
the Loader itself (``loader``)."""

"""What only the command line uses: the report of ``fastst inspect`` (``inspect``) and
the sample run of ``fastst demo`` (``demo``)."""

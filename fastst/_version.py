"""The version of fastst, in one place: the package and the command line read it here."""
__version__ = "0.1.0"
"""The version of this fastst, as ``pip`` and ``fastst --version`` give it (a str)."""

"""The package version, in one place below everything that records it (`skipkv.hardware`, the CLI).

    python -c "from skipkv.version import __version__; print(__version__)"
"""

__version__ = "0.1.0"

"""cfemu: a coupling-facility (CF) shared-queue emulator built on Redis."""

__version__ = "0.1.0"

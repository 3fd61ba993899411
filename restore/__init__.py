"""restore: CF structure restore/recovery tooling (cfrestore)."""

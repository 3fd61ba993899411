"""backup: CF structure backup tooling (cfbackup)."""

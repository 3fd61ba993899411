"""The persistent store of a structure as an operator runs it (EntireX's PSTORE; docs/pstore.md): its start mode
after a CF loss, and its availability (connected or not, taking new units of work or not).

The availability lives in the structure's header on the CF (pstore.lua), so that every member sees a change at
once; the start mode lives in the group repository (cfemu.repository), which outlives the CF: it is read when the
structure is found lost, exactly when the CF cannot tell it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cfemu.admin import Admin
from cfemu.cf import CF
from cfemu.errors import StructureFailedError
from cfemu.repository import GroupRepository, RepositoryError

HOT, WARM, COLD = "HOT", "WARM", "COLD"
MODES = (HOT, WARM, COLD)
DEFAULT_MODE = HOT  # today's RECAUTO: restore the content
SECTION = "start_modes"  # the group repository's section: structure -> mode
# The group repository's section: structure -> the generations it ran in from a WARM start. Such a generation holds
# none of the persistent content (it is in the older backups and the logs): a restore never starts from a backup or
# a relog pass of one (restore.run), which would replay the logs only from a floor above everything committed
# before the CF loss. backup_begin.lua refuses such a backup; this is the defence behind it.
WARM_SECTION = "warm_generations"


def check_mode(mode: str) -> str:
    upper = mode.upper()
    if upper not in MODES:
        raise ValueError(f"start mode must be one of {', '.join(MODES)}, not {mode!r}")
    return upper


def start_mode(repo: GroupRepository, structure: str) -> str:
    """The structure's start mode after a CF loss (HOT when none was set)."""
    state = repo.load() or {}
    return str(state.get(SECTION, {}).get(structure, DEFAULT_MODE))


def set_start_mode(repo: GroupRepository, structure: str, mode: str) -> str:
    """Set the start mode of a structure the group defines (in the CF or in the repository)."""
    mode = check_mode(mode)
    if repo.structure(structure) is None:
        raise RepositoryError(f"structure {structure} is not defined in the group repository {repo.path}")

    def change(state: dict[str, Any]) -> None:
        state.setdefault(SECTION, {})[structure] = mode

    repo.update(change)
    return mode


def record_warm_generation(repo: GroupRepository, structure: str, gen: int) -> None:
    """Remember that `structure` runs generation `gen` from a WARM start (restore/start_modes.py)."""

    def change(state: dict[str, Any]) -> None:
        gens = state.setdefault(WARM_SECTION, {}).setdefault(structure, [])
        if gen not in gens:
            gens.append(gen)

    repo.update(change)


def warm_generations(repo: GroupRepository, structure: str) -> frozenset[int]:
    """The generations `structure` ran in from a WARM start."""
    state = repo.load() or {}
    return frozenset(int(g) for g in state.get(WARM_SECTION, {}).get(structure, ()))


@dataclass
class PstoreRow:
    structure: str
    state: str  # ACTIVE, FAILED (also: lost with the CF) or RECOVERING
    start_mode: str  # what RECAUTO does after a CF loss
    started: str  # WARM while it runs from a WARM start, else ""
    connected: bool | None  # None: not in the CF
    no_new_uows: str  # "", OPERATOR or FULL
    entries: int
    max_entries: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def status(admin: Admin, repo: GroupRepository) -> list[PstoreRow]:
    """Every structure the CF or the group repository defines, with its persistent store's availability."""
    names = {s.name for s in admin.structures()} | set(repo.structures())
    cf = CF(admin.redis)
    rows = []
    for name in sorted(names):
        s = cf.structure(name)
        try:
            st = s.pstore()
        except StructureFailedError:
            rows.append(PstoreRow(name, "FAILED", start_mode(repo, name), "", None, "", 0, 0))
            continue
        info = s.info()
        rows.append(PstoreRow(name, st.state, start_mode(repo, name), st.started, st.connected, st.no_new_uows,
                              int(info.get("entries", 0)), int(info.get("max_entries", 0))))
    return rows


__all__ = ["COLD", "HOT", "MODES", "WARM", "PstoreRow", "check_mode", "record_warm_generation", "set_start_mode",
           "start_mode", "status", "warm_generations"]

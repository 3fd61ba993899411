"""Errors of the CF and the queue managers, each with the IBM MQ reason code an MQ programmer would expect."""

from __future__ import annotations

from typing import Any


class MQError(Exception):
    """Base error: carries an MQ-like reason code and name (MQRC_*)."""

    reason: int = 2195  # MQRC_UNEXPECTED_ERROR
    reason_name: str = "MQRC_UNEXPECTED_ERROR"

    def __str__(self) -> str:
        return f"{self.reason_name} ({self.reason}): {super().__str__()}"


class NoMessageError(MQError):
    reason, reason_name = 2033, "MQRC_NO_MSG_AVAILABLE"


class UnknownObjectError(MQError):
    reason, reason_name = 2085, "MQRC_UNKNOWN_OBJECT_NAME"


class StructureFullError(MQError):
    reason, reason_name = 2192, "MQRC_STORAGE_MEDIUM_FULL"


class StructureFailedError(MQError):
    reason, reason_name = 2373, "MQRC_CF_STRUC_FAILED"
    maybe_applied = False  # the request reached the CF and its reply was lost: the call may have taken effect
    no_answer = False  # the CF did not answer (unreachable, reset, timed out), unlike a structure that said FAILED


class StructureNotInCFError(StructureFailedError):
    """The CF holds no such structure: it was never defined, or the CF was lost with it (an operator looks:
    defines it, or restores it), unlike a structure that is there but FAILED or busy."""


class StructureMigratedError(StructureFailedError):
    """The structure is MIGRATED: a store migration's source, whose messages its target serves now. Unlike a
    failed or recovering structure it stays so until an operator abandons the migration ('cfemu migrate reopen'):
    trying again later changes nothing."""


class FencedError(MQError):
    """This queue manager's epoch is stale (peer recovery took over its work): it must restart."""

    reason, reason_name = 2009, "MQRC_CONNECTION_BROKEN"


class NotJoinedError(StructureFailedError):
    """The structure does not know this member (it was rebuilt after a CF loss): join the group again."""


class LogFailedError(MQError):
    """This queue manager's record log cannot be written (disk full, I/O error): persistent work is refused, and
    non-persistent work goes on until the member is restarted (docs/pstore.md)."""

    reason, reason_name = 2102, "MQRC_RESOURCE_PROBLEM"


class ClientGoneError(MQError):
    """The client that asked left before the answer: a waiting get ends, and takes nothing."""

    reason, reason_name = 2009, "MQRC_CONNECTION_BROKEN"


class ResourceProblemError(MQError):
    """A local limit was reached (every CF connection busy): try again; nothing is wrong with the CF."""

    reason, reason_name = 2102, "MQRC_RESOURCE_PROBLEM"


class BackedOutError(MQError):
    reason, reason_name = 2003, "MQRC_BACKED_OUT"


class SyncpointLimitError(MQError):
    """A put or get under syncpoint that would take its unit of work past the queue manager's MAXUMSGS (the messages
    put and got in one unit of work): refused, nothing changed; the unit of work stays open, to be committed or
    backed out."""

    reason, reason_name = 2024, "MQRC_SYNCPOINT_LIMIT_REACHED"


class OutcomeUnknownError(MQError):
    """The commit's outcome is not known (the connection died during commit)."""

    reason, reason_name = 2009, "MQRC_CONNECTION_BROKEN"
    # What a get whose commit's outcome is not known (or pending, below) delivered all the same (a get outside
    # syncpoint, a conversation's receive of a message outside a unit of work): the message, as the call would have
    # returned it; None for a commit that delivers nothing. Taken and logged, it is never consumed for nobody;
    # should the commit not be on disk (or a restore read the logs before it), the message is delivered again
    # later (docs/client.md, "Outcome pending").
    message: Any = None


class OutcomePendingError(OutcomeUnknownError):
    """A commit whose COMMIT record was forced, but that a structure of its unit of work could not take then (the
    structure failed or being restored, or the CF unreachable): the queue manager completes it when the structure
    is back, committed, unless a restore of the structure read the logs before the COMMIT was forced and backed the
    unit of work out (then the queue manager learns that and logs it). Until then the application cannot know which
    (docs/uow.md, "When a commit's outcome is pending"). IBM MQ answers an MQCMIT so on z/OS when a queue manager
    loses its connection to a CF structure during the commit (MQCC_WARNING)."""

    reason, reason_name = 2124, "MQRC_OUTCOME_PENDING"


class InDoubtError(MQError):
    reason, reason_name = 2352, "MQRC_UOW_IN_DOUBT"  # nearest MQ code: the unit of work is in doubt


class BadRequestError(MQError):
    reason, reason_name = 2046, "MQRC_OPTIONS_ERROR"


class MessageTooBigError(MQError):
    reason, reason_name = 2030, "MQRC_MSG_TOO_BIG_FOR_Q"


class TruncatedMessageError(MQError):
    """The message a get would take is longer than the caller can carry (a buffer, a frame): it stays where it
    was, untouched, as MQ leaves it for a buffer too small without MQGMO_ACCEPT_TRUNCATED_MSG."""

    reason, reason_name = 2080, "MQRC_TRUNCATED_MSG_FAILED"


class BackupRunningError(MQError):
    reason, reason_name = 2362, "MQRC_CF_STRUC_IN_USE"  # nearest code: BACKUP CFSTRUCT already running


class BackupEndedError(BadRequestError):
    """The backup's mark is no longer its own (cancelled, replaced by a later backup after its lease ended, lost
    with the CF), or its lease has ended: the backup cannot end well."""


class FloorError(MQError):
    """Internal: a log-first record lies below the structure's recovery floor; log a fresh record and retry."""

    def __init__(self, floor: int) -> None:
        super().__init__(f"record below recovery floor {floor}")
        self.floor = floor


class BackupActiveError(MQError):
    """Internal: a backup is running, so the BACKOUT record must carry the data of the gets it backs out."""


class RelogBusyError(MQError):
    """Internal: another member holds the structure's relog lock (docs/log-management.md): it relogs it."""


class PstoreUnavailableError(StructureFailedError):
    """Persistent work on a structure whose persistent store is disconnected (cfemu pstore disconnect, or a WARM
    start; docs/pstore.md): refused, nothing changed; non-persistent work goes on. A failed structure for the code
    that skips a structure it cannot use now (the UOW sweeper), with EntireX's kind of reason: a resource problem."""

    reason, reason_name = 2102, "MQRC_RESOURCE_PROBLEM"


class NoNewUowsError(MQError):
    """A put while the structure takes no new units of work (set by an operator, or by the structure reaching its
    capacity; docs/pstore.md): only consuming work is allowed. Nothing changed."""

    reason, reason_name = 2102, "MQRC_RESOURCE_PROBLEM"


class CompletedByRecoveryError(MQError):
    """Internal: recovery already committed this unit of work."""


def from_script_error(message: str, structure: str) -> MQError:
    """Map a CF script's error reply ('CODE detail') to the matching exception."""
    code, _, detail = message.partition(" ")
    where = f"structure {structure}: {detail}"
    if code == "FLOOR":
        return FloorError(int(detail))
    mapping: dict[str, type[MQError]] = {
        "NOSTRUCT": StructureNotInCFError,
        "CFSTATE": StructureFailedError,
        "FENCED": FencedError,
        "NOTJOINED": NotJoinedError,
        "FULL": StructureFullError,
        "NOQUEUE": UnknownObjectError,
        "BACKEDOUT": BackedOutError,
        "COMPLETED": CompletedByRecoveryError,
        "BACKUPACTIVE": BackupActiveError,
        "BACKUPRUNNING": BackupRunningError,
        "BADUOW": BadRequestError,
        "BADARG": BadRequestError,
        "NOBACKUP": BackupEndedError,
        "TOOLONG": TruncatedMessageError,
        "RELOGBUSY": RelogBusyError,
        "PSTORE": PstoreUnavailableError,
        "NONEW": NoNewUowsError,
    }
    cls = mapping.get(code, MQError)
    if code == "CFSTATE" and detail.endswith(" MIGRATED"):
        return StructureMigratedError(f"{where}: a store migration's source, its messages served by its target "
                                      f"(only if the migration is abandoned: 'cfemu migrate reopen {structure} "
                                      f"--confirm {structure}')")
    if cls is UnknownObjectError:
        return cls(f"queue {detail} is not defined on structure {structure}")
    return cls(where if cls is not MQError else f"structure {structure}: {message}")


# --- units of work sent to a service (sqm.conversations.conversation; EntireX's units of work: docs/uow.md) ---------------------
class UowStatusError(MQError):
    """A UOW operation not allowed in the UOW's status (the state table of sqm.conversations.uowstatus), or by this caller: the
    message names the operation and the status."""

    reason, reason_name = 2046, "MQRC_OPTIONS_ERROR"


class EndOfUowError(MQError):
    """A receive past the last message of the UOW being received (EntireX 00740301: end of unit of work)."""

    reason, reason_name = 2033, "MQRC_NO_MSG_AVAILABLE"


class UowLimitError(MQError):
    """A service's MAX-UOWS or MAX-MESSAGES-IN-UOW was reached."""

    reason, reason_name = 2102, "MQRC_RESOURCE_PROBLEM"


class LogonThrottledError(MQError):
    """A logon with yet another token for a user id whose logons have tried many different tokens lately (a token
    being guessed: sqm.conversations.logon_guesses); try again later."""

    reason, reason_name = 2035, "MQRC_NOT_AUTHORIZED"


class UnknownUowError(MQError):
    """No UOW with that id (never sent, or its status was not kept: it is not persistent, or it was deleted)."""

    reason, reason_name = 2085, "MQRC_UNKNOWN_OBJECT_NAME"

"""The EntireX conversations wing: LOGON, SEND, RECEIVE, SYNCPOINT, units of work sent to services and their
statuses, and the sweeper of their lifetimes (docs/uow.md). Installed on a queue manager by wing.install."""

"""sqm: the shared-queue manager built on the cfemu coupling facility."""

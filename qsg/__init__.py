"""qsg: the queue-sharing group as an operator runs it (floor 5, the top): the cfemu command, group status,
the local cluster, the demo and the chaos suite."""

"""The network skin over the queue manager: the asyncio service (sqm run), its wire protocol, the client
library and the Prometheus metrics."""

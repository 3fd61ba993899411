"""The group's web console (docs/console.md): an aiohttp server that an operator logs into with the group's
operator token, showing the group at a glance and running operator actions with confirmation.

  source    where the group is found (settings, local cluster, member endpoints, TLS)
  snapshot  one picture of the group, taken by the console's poller
  history   the charts' samples and the events seen between snapshots
  charts    SVG line charts, drawn on the server
  jobs      the actions under way, with their progress
  actions   the operator actions, one row each
  security  login, session cookie, CSRF
  app       the web application
"""

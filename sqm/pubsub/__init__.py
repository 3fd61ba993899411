"""The publish/subscribe wing: topics, subscriptions, publications and their sweeper (docs/pubsub.md). Installed
on a queue manager by wing.install."""

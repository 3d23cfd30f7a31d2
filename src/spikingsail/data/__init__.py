"""Data loading: per-rank shards, and the bundled real data set."""

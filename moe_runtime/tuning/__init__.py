"""Plans chosen by measurement: ``moe-runtime tune`` times the candidates the planner computes,
writes a cache keyed by device, environment and plugin versions, and the planner reads it to break
ties between equally exact backends (docs/tuning.md).

``cache`` holds the file's schema, keys, loading and the measured choice; ``measure`` the timer
and the tuning loop; ``command`` the CLI. Importing this package imports none of them.
"""

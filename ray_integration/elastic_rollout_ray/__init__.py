"""Elastic Rollout on a Ray cluster.

``python -m elastic_rollout_ray.launch --fully-async ...`` (usually via ``ray job submit``) starts
the manager in a Ray actor, reconciles its engine placements with Ray placement groups and node
agents, and serves the control API through Ray Serve. The contract with the manager is
``docs/ray.md``; the plain process wrapper (:mod:`.process`) and the Unix-socket helpers
(:mod:`.uds`; the client itself is ``elastic_rollout``'s, with ``uds=``) work without Ray.
"""

"""Elastic runs (`topology.elastic = true`, docs/design.md §10.1): clusters that leave and join between outer rounds.

One concept per module: the torchft Lighthouse as the clusters reach it (lighthouse.py), each round's membership over
torchft (membership.py), what the members tell each other and how a cluster's ranks take one way (vote.py), the
round boundary that settles the sync in flight among the live clusters (rounds.py), members that stall in a
transfer (stall.py), and the membership changes as lines and records (events.py). The launcher that starts an
elastic run's clusters and restarts them is `dilocox.launch.elastic`.
"""

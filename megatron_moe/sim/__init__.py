"""Synthetic routing for planners, benchmarks and (issue #13) the cluster simulator."""

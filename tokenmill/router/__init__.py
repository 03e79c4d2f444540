"""The load balancer in front of engine replicas (`tokenmill router`, `serve --data-parallel-size`):
an HTTP client of the replicas that imports nothing of the engine."""

"""Running one model across several processes: tensor-parallel sharding and collectives
(tensor_parallel.py), and the executors that start the worker ranks and feed them each step
(executor.py: local processes; ray_executor.py: Ray actors)."""

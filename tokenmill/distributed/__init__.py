"""Running one model across several processes: the ranks' collectives (tensor_parallel.py; how
the model is cut is layers/tensor_parallel.py), and the executors that start the worker ranks and
feed them each step (executor.py: local processes; ray_executor.py: Ray actors; launch.py picks)."""

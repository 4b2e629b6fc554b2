"""The ground floor: the device's memory, how the run executes (device, precision, CUDA
graphs, ranks, FSDP sharding) and its profiler. A module here imports only the standard
library, torch, :mod:`prism_select.errors`, :mod:`prism_select.settings` and the others here.
"""

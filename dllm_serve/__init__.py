"""The command line (``dllm-serve``): the layer above the packages it launches. ``cli`` is the command, ``status`` the
worker monitor, ``slurm`` the sbatch submission (the one-time DCP conversion is common/dcp_cache.py). Imports
go one way: ``common`` < ``worker``, ``balancer`` < ``dllm_serve`` (tests/test_docs.py checks)."""

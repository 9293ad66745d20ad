"""The command line (``dllm-serve``): the layer above the packages it launches. ``cli`` is the command, ``status`` the
worker monitor, ``slurm`` the sbatch submission, ``dcp_launch`` the one-time DCP conversion before a launch. Imports
go one way: ``common`` < ``worker``, ``balancer`` < ``dllm_serve`` (tests/test_docs.py checks)."""

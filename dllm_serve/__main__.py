"""``python -m dllm_serve``: the ``dllm-serve`` command."""
from dllm_serve.cli import main

main()

#!/usr/bin/env python3
"""Worker status of a running dllm-serve (thin wrapper over `dllm-serve status`).

  scripts/check_worker_status.py --url http://localhost:8000 --monitor --interval 2
  scripts/check_worker_status.py --json      # exit code: 0 all healthy, 1 degraded, 2 down, draining or unreachable
"""
import sys

import _venv  # noqa: F401  (re-runs this script with the project's .venv)

from dllm_serve.cli import one_line_errors, status  # noqa: E402

if __name__ == "__main__":
    one_line_errors(lambda: status.main(sys.argv[1:], prog_name="check_worker_status.py", standalone_mode=False,
                                        help_option_names=["-h", "--help"], max_content_width=110))

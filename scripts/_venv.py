"""Imported first by the Python scripts here: run them with the project's .venv whatever `python3` launched them
(creating .venv with scripts/setup_venv.sh when it is missing), so `scripts/x.py` works as the README writes it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"


def ensure() -> None:
    if Path(sys.prefix).resolve() == VENV.resolve():
        sys.path.insert(0, str(ROOT))
        return
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_venv.sh")], check=True, stdout=sys.stderr)
    python = VENV / "bin" / "python"
    script = Path(sys.argv[0]).resolve()
    os.execv(str(python), [str(python), str(script), *sys.argv[1:]])


ensure()

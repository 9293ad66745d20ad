"""Docs say what the code does now."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_is_current():
    # a fresh interpreter: click caches per-command help options, so other tests' invocations must not leak in
    import subprocess
    import sys
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_cli_docs.py"), "--stdout"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert (ROOT / "docs" / "cli.md").read_text() == out, "run scripts/gen_cli_docs.py"


def test_readme_starts_with_the_two_commands():
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("./scripts/")]
    assert lines[0].startswith("./scripts/start_server.sh --local") and lines[1].startswith("./scripts/test.sh")
    assert (ROOT / ".ci" / "run").read_text().count("scripts/test.sh") == 1


def test_balancer_never_imports_torch():
    import subprocess
    import sys
    code = "import sys, balancer.app, balancer.supervisor, common.cli, common.status; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

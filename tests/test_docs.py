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
    code = "import sys, balancer.app, balancer.supervisor, dllm_serve.cli, dllm_serve.status; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# the layers, bottom up, and what each may import of the project (docs/architecture.md "Imports go one way")
LAYERS = {"common": {"common"}, "worker": {"common", "worker"}, "balancer": {"common", "balancer"},
          "dllm_serve": {"common", "worker", "balancer", "dllm_serve"}}


def project_imports(path: Path) -> set[str]:
    """The project packages a module imports, at its top or inside functions (absolute imports; relative ones stay
    inside their own package)."""
    import ast
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & set(LAYERS)


def test_imports_go_one_way():
    """common < worker, balancer < dllm_serve (the command line): no module imports a layer above its own, and the
    worker and the balancer never import each other."""
    bad = [f"{p.relative_to(ROOT)} imports {sorted(project_imports(p) - allowed)}"
           for pkg, allowed in LAYERS.items() for p in sorted((ROOT / pkg).rglob("*.py"))
           if project_imports(p) - allowed]
    assert bad == []
    assert project_imports(ROOT / "dllm_serve" / "cli.py") >= {"worker", "balancer"}   # the check sees imports


def test_the_request_trace_names_real_files_every_family_and_every_algorithm():
    """docs/architecture.md's trace of a request: every file it names exists, and its family and algorithm lists are
    the registries'."""
    import re
    text = (ROOT / "docs" / "architecture.md").read_text()
    trace = text[text.index("## One request, file by file"):text.index("## Configuration")]
    files = set(re.findall(r"`((?:common|worker|balancer|dllm_serve)/[\w/]+\.py)`", trace))
    assert files and all((ROOT / f).is_file() for f in files), files
    assert {"common/openai_http.py", "worker/serving.py", "worker/scheduler.py"} <= files
    families = re.search(r"`worker/models/<family>\.py` \(([^)]*)\)", trace).group(1)
    from worker.models import FAMILY_MODULES
    assert re.findall(r"`(\w+)`", families) == list(FAMILY_MODULES)
    algorithms = set(re.findall(r"`(\w+)`", re.search(r"`worker/engine/algorithms/<name>\.py` \(([^)]*)\)",
                                                       trace).group(1)))
    modules = {p.stem for p in (ROOT / "worker/engine/algorithms").glob("*.py")} - {"__init__", "block_causal"}
    assert algorithms == modules

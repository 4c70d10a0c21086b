"""The project's shape: no import cycle among the top-level modules, no library module that
imports a command line, model.py importing nothing of the project but leaves, no sys.path edits."""
import ast

import pytest

from conftest import ROOT, run_script

COMMAND_LINES = {"generate", "download", "quantize", "eval", "convert_hf_checkpoint", "serve"}
# modules whose command line is a thin `main` over importable functions: libraries may use those
LIBRARY_TOO = {"quantize"}


def project_imports() -> dict:
    """module -> the project's modules it imports anywhere in its body (lazy imports count)."""
    modules = {p.stem: p for p in ROOT.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module.split(".")[0])
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict):
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_cycle():
    assert find_cycle(project_imports()) is None, " -> ".join(find_cycle(project_imports()))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_library_module_imports_a_command_line():
    graph = project_imports()
    for name, deps in graph.items():
        bad = deps & (COMMAND_LINES - LIBRARY_TOO)
        assert not bad, f"{name}.py imports the command line {', '.join(sorted(bad))}"


def test_model_imports_nothing_of_the_project_but_leaves():
    """model.py reads on its own: what it imports (RoPE, the config checks, the table of thresholds)
    imports nothing of the project."""
    graph = project_imports()
    assert graph["model"] <= {"rope", "config_checks", "thresholds", "kvcache"} and all(not graph[m] for m in graph["model"])


def test_the_scheduler_imports_no_torch():
    """The scheduler and the block manager are bookkeeping in plain Python, readable and testable alone."""
    for name in ("scheduler", "blocks"):
        tree = ast.parse((ROOT / f"{name}.py").read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert "torch" not in imported and not imported & {"engine", "model", "sampling", "kernels"}, name


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 60


def test_no_file_or_function_is_too_long():
    """A top-level file stays under about 600 lines and a function under about 60, so that a reader
    finds one concern per file and a function on one screen."""
    for path in sorted(ROOT.glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= MAX_FUNCTION_LINES, f"{path.name}: {node.name} is {length} lines"


def test_nothing_edits_sys_path():
    for path in [*ROOT.glob("*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("tests/*.py")]:
        text = path.read_text()
        assert not any(f"sys.path.{edit}(" in text for edit in ("insert", "append")), path.name


SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_runs_as_a_module_from_the_root(script):
    r = run_script("-m", f"scripts.{script}", "--help")
    assert r.returncode == 0, r.stderr
    assert f"scripts.{script}" in r.stdout  # its usage names the way it is run

"""The layer rules of pyproject.toml's [tool.importlinter] contracts hold (import-linter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "4 kept, 0 broken" in proc.stdout  # every contract was checked


def _mopflow_import_graph() -> dict[str, set[str]]:
    """Each mopflow module and the mopflow modules it imports, function-local imports and imports
    made only for type checking included: a cycle that type checking alone needs is still two
    halves of one thing."""
    import grimp

    graph = grimp.build_graph("mopflow", cache_dir=None, exclude_type_checking_imports=False)
    return {
        module: {m for m in graph.find_modules_directly_imported_by(module) if m.startswith("mopflow")}
        for module in graph.modules
        if module.startswith("mopflow")
    }


def _a_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``edges`` (its modules in order), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for imported in sorted(edges.get(module, ())):
            if state.get(imported) == 1:
                return path[path.index(imported) :] + [imported]
            if imported not in state and (found := visit(imported)):
                return found
        path.pop()
        state[module] = 2
        return []

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle_not_even_through_function_local_imports() -> None:
    """A function-local import that only keeps a cycle from failing at import time still shows here."""
    edges = _mopflow_import_graph()
    assert len(edges) > 100  # the whole package was read
    assert _a_cycle(edges) == []


def test_no_product_module_is_over_400_lines() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / "mopflow").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long


TOP_LEVEL = ("training", "compression", "infra", "dags", "plugins")


def test_the_package_holds_the_files_and_the_top_level_folders_link_into_it() -> None:
    assert not [str(p) for p in (REPO / "mopflow").rglob("*") if p.is_symlink()]
    for name in TOP_LEVEL:
        assert (REPO / name).is_symlink() and (REPO / name).resolve() == REPO / "mopflow" / name


def test_a_module_cannot_load_under_a_second_name() -> None:
    """With the repository root on sys.path (as `python -m pytest` and `python -c` in the checkout
    put it), importing a part through its top-level link is refused rather than loading a second
    copy of it, with its own classes and registries, beside ``mopflow.<part>``."""
    assert not [name for name in sys.modules if name.split(".")[0] in TOP_LEVEL]
    for name in TOP_LEVEL:
        code = f"import mopflow.{name}, importlib; importlib.import_module('{name}')"
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        assert (
            f"ImportError: import mopflow.{name}, not {name} (the repository root is on sys.path)"
            in proc.stderr
        )


def test_the_stages_coordinators_import_no_lightning() -> None:
    """Lightning (about 2 s of CPU to import) loads where models train, on the workers: the
    pipeline's stages, whose task processes coordinate, never import it themselves."""
    code = (
        "import sys\n"
        "import mopflow.pipeline.search, mopflow.pipeline.ensemble, mopflow.pipeline.distill\n"
        "import mopflow.pipeline.register, mopflow.compression.distill.distill\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('pytorch_lightning', 'lightning')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"

"""The packages form layers, and every import points down them:

    proto → compression → ps_server, worker → p4, thc_ps → deploy

(each folder is imported as thc_ps.FOLDER; proto owns the wire and job contract and imports no
other package of the project; ps_server and worker do not import each other; thc_ps's own
modules, the library a training script imports, sit on worker).  Imports inside functions
count too: a lazy import that points up is still a back-arrow."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"proto": 0, "compression": 1, "ps_server": 2, "worker": 2, "p4": 3, "thc_ps": 3, "deploy": 4}


def absolute_imports():
    """(file, its package, module, [module.name of each name imported from it]) for every
    absolute import in the packages' files."""
    for pkg in LAYER:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        yield path.relative_to(ROOT), pkg, a.name, []
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    yield path.relative_to(ROOT), pkg, node.module, [f"{node.module}.{a.name}" for a in node.names]


def layer_of(module: str) -> str | None:
    """The package an import names: thc_ps.X is X (a folder of the checkout); thc_ps and
    thc_ps.torch, thc_ps.lightning are the library; anything else is not the project's."""
    parts = module.split(".")
    if parts[0] != "thc_ps":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYER else "thc_ps"


def test_every_import_points_down_the_layers():
    found = [(path, pkg, m) for path, pkg, m, _ in absolute_imports()
             if layer_of(m) is not None and layer_of(m) != pkg]
    assert any(pkg == "deploy" and layer_of(m) == "worker" for _, pkg, m in found)   # the scan sees imports
    up = [f"{path}: {pkg} imports {m}" for path, pkg, m in found if LAYER[layer_of(m)] >= LAYER[pkg]]
    assert not up, "imports that point up or sideways:\n" + "\n".join(up)


#: P4Runtime's generated bindings (PyPI's p4runtime): a top-level `p4` that is not ours
P4RUNTIME = ("p4.v1", "p4.config")


def test_the_project_is_imported_under_thc_ps_only():
    """A user's own worker.py or proto.py must not meet ours: the packages are imported as
    thc_ps.worker, thc_ps.proto, … everywhere (the folders keep their names), and a top-level
    import of one would load a second copy of it."""
    top = {p for p in LAYER if p != "thc_ps"}
    files = [*((ROOT / pkg).rglob("*.py") for pkg in LAYER), (ROOT / "tests").rglob("*.py"),
             (ROOT / "bench").rglob("*.py"), (ROOT / "examples").rglob("*.py")]
    bad = [f"{path.relative_to(ROOT)}: {m}" for group in files for path in group
           for m in _imported(path) if m.split(".")[0] in top and not m.startswith(P4RUNTIME)]
    assert not bad, "top-level imports of the project's packages:\n" + "\n".join(bad)


def _imported(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_the_registry_implements_exactly_the_codecs_a_job_may_name():
    from thc_ps.compression import registry
    from thc_ps.proto.job import CODECS
    assert registry.names() == list(CODECS)

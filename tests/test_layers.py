"""The packages form layers, and every import points down them:

    proto → compression → ps_server, worker → p4, thc_ps → deploy

(proto owns the wire and job contract and imports no other package of the project; ps_server
and worker do not import each other; thc_ps, the library a training script imports, sits on
worker).  Imports inside functions count too: a lazy import that
points up is still a back-arrow."""
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


def test_every_import_points_down_the_layers():
    found = [(path, pkg, m) for path, pkg, m, _ in absolute_imports()
             if m.split(".")[0] in LAYER and m.split(".")[0] != pkg]
    assert any(pkg == "deploy" and m.startswith("worker") for _, pkg, m in found)   # the scan sees imports
    up = [f"{path}: {pkg} imports {m}" for path, pkg, m in found if LAYER[m.split(".")[0]] >= LAYER[pkg]]
    assert not up, "imports that point up or sideways:\n" + "\n".join(up)


def test_the_registry_implements_exactly_the_codecs_a_job_may_name():
    from compression import registry
    from proto.job import CODECS
    assert registry.names() == list(CODECS)

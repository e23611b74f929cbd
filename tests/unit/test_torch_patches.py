"""The agent and worker sides replace no attribute of torch but the few docs/architecture.md lists, each
with why no subclass or hook reaches it, and keep no `_torchrevive_*` state on torch's objects (issue 53).

The scan reads elastic/_agent's and elastic/_worker's source: an assignment (`X.attr = ...`, `setattr(X, ...)`) whose `X` is
torch's (a name imported from torch, or one bound to `getattr` of one, or to `sys.modules` of one) is a
patch; what torch's objects hold at run time (an agent's, a worker group's state) is not."""

from __future__ import annotations

import ast
import fnmatch
import re

from support import REPO

SIDES = (REPO / "elastic" / "_agent", REPO / "elastic" / "_worker")
PAGE = REPO / "docs" / "architecture.md"

ALLOWED = {
    ("elastic._agent.rendezvous.worker_port", "torch.distributed.elastic.rendezvous.api.get_free_port"),
    ("elastic._agent.launcher.warm_preload", "torch._C.*"),
    ("elastic._worker.survivors.groups", "torch.distributed.distributed_c10d._world.group_count"),
}
"""(module, torch attribute) of every patch left; `*`: an attribute named at run time."""


def _torchs(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def _qualified(node: ast.expr, bound: dict[str, str]) -> str | None:
    """The torch object `node` names (dotted), or None when it is not torch's."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _qualified(node.value, bound)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) > 1:
        base, name = _qualified(node.args[0], bound), node.args[1]
        if base:
            return f"{base}.{name.value}" if isinstance(name, ast.Constant) else f"{base}.*"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        key = node.args[0]
        if "modules" in ast.unparse(node.func.value) and isinstance(key, ast.Constant) and _torchs(str(key.value)):
            return str(key.value)
    if isinstance(node, ast.Subscript) and "modules" in ast.unparse(node.value):
        key = node.slice
        if isinstance(key, ast.Constant) and _torchs(str(key.value)):
            return str(key.value)
    return None


def patches_in(source: str) -> set[str]:
    """The torch attributes `source` assigns (dotted; `*` for a name known only at run time)."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _torchs(alias.name):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _torchs(node.module):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    grew = True
    while grew:  # names bound to torch's objects, e.g. `native = getattr(sys.modules.get("torch"), "_C")`
        grew = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                named = _qualified(node.value, bound)
                for target in node.targets:
                    if named and isinstance(target, ast.Name) and target.id not in bound:
                        bound[target.id], grew = named, True
    found = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            owner = _qualified(target.value, bound) if isinstance(target, ast.Attribute) else None
            if owner:
                found.add(f"{owner}.{target.attr}")  # type: ignore[union-attr]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            owner = _qualified(node.args[0], bound) if node.args else None
            if owner:
                name = node.args[1] if len(node.args) > 1 else None
                found.add(f"{owner}.{name.value if isinstance(name, ast.Constant) else '*'}")
    return found


def agent_side_patches() -> set[tuple[str, str]]:
    """Every patch in the agent's and the worker's packages (the name is the agent's: most are there)."""
    found = set()
    for path in sorted(path for side in SIDES for path in side.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found |= {(module, name) for name in patches_in(path.read_text())}
    return found


def test_the_agent_side_patches_only_the_listed_torch_attributes() -> None:
    found = agent_side_patches()
    assert found == ALLOWED, (
        f"torch attributes replaced that are not listed: {sorted(found - ALLOWED)} (override a method of "
        f"ReviveAgent, or a hook, instead; or list it here and in docs/architecture.md with why no subclass "
        f"reaches it); listed but gone: {sorted(ALLOWED - found)}"
    )


def test_each_patch_left_is_named_in_the_architecture_page_with_its_module() -> None:
    section = PAGE.read_text().split("\n## The agent\n", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n- ", section)[1:]
    assert len(items) == len(ALLOWED)
    for module, name in ALLOWED:
        assert any(f"(`{module.removeprefix('elastic._worker.')}`)" in item
                   and any(fnmatch.fnmatch(name, named) or fnmatch.fnmatch(name, f"*.{named}") or fnmatch.fnmatch(named, name)
                           for named in re.findall(r"`((?:torch|distributed_c10d)\.[\w.*]+)`", item))
                   for item in items), f"{name} ({module}) is not in docs/architecture.md's list"


def test_no_torchrevive_state_on_torchs_objects() -> None:
    """The agent's state is on `ReviveAgent` and its collaborators, in attributes of their own."""
    holders = [str(path.relative_to(REPO)) for path in sorted((REPO / "elastic").rglob("*.py"))
               if "_torchrevive_" in path.read_text()]
    assert holders == []


def test_the_scan_finds_a_new_patch_in_each_form_and_no_state_of_torchs_objects() -> None:
    source = (
        "import sys\n"
        "import torch.distributed.elastic.multiprocessing.api as mp_api\n"
        "from torch.distributed.elastic.agent.server import local_elastic_agent\n"
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "def install(self, worker_group, name):\n"
        "    from torch.distributed.elastic.rendezvous import api\n"
        "    LocalElasticAgent._monitor_workers = f\n"
        "    local_elastic_agent.start_processes = f\n"
        "    mp_api._terminate_process_handler = f\n"
        "    setattr(api, 'get_free_port', f)\n"
        "    native = getattr(sys.modules.get('torch'), '_C', None)\n"
        "    setattr(native, name, f)\n"
        "    self._remaining_restarts = 0\n"          # an agent's own state
        "    worker_group.state = 'STOPPED'\n"         # a worker group's
        "    holder = getattr(worker_group, 'store')\n"
        "    holder._last_sync_time = -1\n"
    )
    assert patches_in(source) == {
        "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent._monitor_workers",
        "torch.distributed.elastic.agent.server.local_elastic_agent.start_processes",
        "torch.distributed.elastic.multiprocessing.api._terminate_process_handler",
        "torch.distributed.elastic.rendezvous.api.get_free_port",
        "torch._C.*",
    }

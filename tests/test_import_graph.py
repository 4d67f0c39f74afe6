"""tf_pxg's import graph: no cycles, and the engine in layers.

The graph is read from the source (ast), with every import statement,
module-level or inside a function: the package imports late (inside
functions) where a module-level import would be circular or would load
TensorFlow early, and a late import closes a cycle all the same.

* Modules: no cycle among tf_pxg's modules (a package's `__init__` is the
  package's node).
* Units: no cycle among tf_pxg's units, a unit being a subpackage (all its
  modules as one node: `tf_pxg.rules`, `tf_pxg.tape`, `tf_pxg.keras`...) or
  a top-level module (`tf_pxg.gradient_tape`).
* The engine's layers (`ENGINE_LAYERS`, bottom first; a layer is a
  folder, the tape API one module): a module imports
  engine modules of its own layer or below, never above, and nothing from
  outside the engine but the foundation (`FOUNDATION`).
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set

import tf_pxg

_PACKAGE = pathlib.Path(tf_pxg.__file__).parent

# Below the engine: the TF/Keras boundary, versions, XLA and native-kernel
# probes, and the rule registry (a dict).
FOUNDATION = ("tf_pxg._compat", "tf_pxg._versions", "tf_pxg.xla",
              "tf_pxg.native", "tf_pxg.registry")

# The engine, bottom first: recording, the interface (where the examples
# are, and where each rule takes them), backprop, the per-example rules,
# the per-example backward pass over them, and the tape API on top.
ENGINE_LAYERS = (
    ("recording", ("tf_pxg.tape",)),
    ("interface", ("tf_pxg.interface",)),
    ("backprop", ("tf_pxg.backprop",)),
    ("rules", ("tf_pxg.rules",)),
    ("per-example backprop", ("tf_pxg.per_example",)),
    ("tape API", ("tf_pxg.gradient_tape",)),
)

# What the engine may import from above it: the tape API's
# `clipped_gradient_sum` clips with `tf_pxg.dp.clipping.clip_factors`,
# which imports nothing of tf_pxg but the side-release protocol (its
# adaptive policy's count) and the parts' registry idiom
# (`tf_pxg.parts.add`), which import nothing of tf_pxg (checked below).
ENGINE_UPWARD = {"tf_pxg.gradient_tape": ("tf_pxg.dp.clipping",
                                          "tf_pxg.dp.releases",
                                          "tf_pxg.parts")}


def module_names() -> Dict[str, pathlib.Path]:
  """Module name -> file, a package named by its `__init__.py`."""
  out = {}
  for path in sorted(_PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(_PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _resolve(name: str, modules) -> Optional[str]:
  """The longest prefix of dotted `name` that is a tf_pxg module."""
  parts = name.split(".")
  for n in range(len(parts), 0, -1):
    candidate = ".".join(parts[:n])
    if candidate in modules:
      return candidate
  return None


def imports_of(module: str, source: str, modules) -> Set[str]:
  """tf_pxg modules that `source` (module `module`) imports, anywhere."""
  is_package = modules[module].name == "__init__.py"
  package = module if is_package else module.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(source)):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")
        up = up[:len(up) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      # `from a import b`: the module a.b if it is one, else a.
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
               for a in node.names]
    for name in names:
      target = (_resolve(name, modules) if name.split(".")[0] == "tf_pxg"
                else None)
      if target is not None and target != module:
        found.add(target)
  return found


def import_graph() -> Dict[str, Set[str]]:
  modules = module_names()
  return {m: imports_of(m, p.read_text(encoding="utf-8"), modules)
          for m, p in modules.items()}


def unit_of(module: str) -> str:
  """`tf_pxg.rules.base` -> `tf_pxg.rules`; top-level modules are units."""
  parts = module.split(".")
  if len(parts) <= 2:
    return module
  return ".".join(parts[:2])


def unit_graph(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
  """Edges between units; the root package `tf_pxg` is left out (its
  `__init__` names the public modules lazily, by strings)."""
  out: Dict[str, Set[str]] = {}
  for module, targets in graph.items():
    if module == "tf_pxg":
      continue
    u = unit_of(module)
    out.setdefault(u, set()).update(
        unit_of(t) for t in targets if unit_of(t) not in (u, "tf_pxg"))
  return out


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
  """One cycle (a list of nodes, first = last) per strongly connected
  component that has one (Tarjan's algorithm, then a path in the SCC)."""
  index, low, stack, on_stack, sccs = {}, {}, [], set(), []
  counter = [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      scc = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        scc.append(w)
        if w == v:
          break
      if len(scc) > 1:
        sccs.append(set(scc))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return [_cycle_in(graph, scc) for scc in sccs]


def _cycle_in(graph, scc: Set[str]) -> List[str]:
  """A shortest cycle through the SCC's first node (breadth-first)."""
  start = min(scc)
  parents = {start: None}
  queue = [start]
  while queue:
    v = queue.pop(0)
    for w in sorted(graph.get(v, ())):
      if w == start:
        path = [v]
        while parents[path[-1]] is not None:
          path.append(parents[path[-1]])
        return [start] + path[::-1][1:] + [start] if len(path) > 1 else [
            start, v, start]
      if w in scc and w not in parents:
        parents[w] = v
        queue.append(w)
  return sorted(scc)


def _fmt(found: List[List[str]]) -> str:
  return "; ".join(" -> ".join(c) for c in found)


def test_cycle_finder_names_a_planted_cycle():
  """The checks below can fail: a three-module cycle and a two-unit cycle
  are found and named; a DAG has none."""
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
  assert cycles(graph) == [["a", "b", "c", "a"]]
  assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
  units = unit_graph({"tf_pxg.x.one": {"tf_pxg.y"},
                      "tf_pxg.y": {"tf_pxg.x.two"}, "tf_pxg.x.two": set()})
  assert cycles(units) == [["tf_pxg.x", "tf_pxg.y", "tf_pxg.x"]]


def test_imports_are_read_at_module_and_function_level():
  modules = {"tf_pxg": None, "tf_pxg.a": pathlib.Path("a.py"),
             "tf_pxg.b": None, "tf_pxg.c": None, "tf_pxg.d": None,
             "tf_pxg.d.e": None}
  source = ("import tf_pxg.b\nfrom tf_pxg import c\n\n\ndef f():\n"
            "  from tf_pxg.d import e\n  import numpy\n")
  assert imports_of("tf_pxg.a", source, modules) == {
      "tf_pxg.b", "tf_pxg.c", "tf_pxg.d.e"}


def test_no_module_cycles():
  found = cycles(import_graph())
  assert not found, f"import cycles among tf_pxg's modules: {_fmt(found)}"


def test_no_unit_cycles():
  found = cycles(unit_graph(import_graph()))
  assert not found, (
      "import cycles among tf_pxg's packages and top-level modules: "
      f"{_fmt(found)}")


def _layer_of(module: str) -> Optional[int]:
  for i, (_, units) in enumerate(ENGINE_LAYERS):
    if unit_of(module) in units or module in units:
      return i
  return None


def test_engine_layers():
  """Each engine module imports engine modules of its layer or below, and
  outside the engine only the foundation (and `ENGINE_UPWARD`)."""
  graph = import_graph()
  named = {u for _, units in ENGINE_LAYERS for u in units}
  assert named <= {unit_of(m) for m in graph}, named - set(graph)
  wrong = []
  for module, targets in sorted(graph.items()):
    layer = _layer_of(module)
    if layer is None:
      continue
    for t in sorted(targets):
      if t in FOUNDATION or t in ENGINE_UPWARD.get(module, ()):
        continue
      target_layer = _layer_of(t)
      if target_layer is None:
        wrong.append(f"{module} ({ENGINE_LAYERS[layer][0]}) imports {t}, "
                     "outside the engine")
      elif target_layer > layer:
        wrong.append(f"{module} ({ENGINE_LAYERS[layer][0]}) imports {t} "
                     f"({ENGINE_LAYERS[target_layer][0]}, above it)")
  assert not wrong, "\n".join(wrong)
  for module in FOUNDATION:
    above = {t for t in graph[module] if t not in FOUNDATION}
    assert not above, f"{module} (foundation) imports {sorted(above)}"
  for upward in ENGINE_UPWARD.values():
    for module in upward:
      assert graph[module] <= set(upward), (module, graph[module])

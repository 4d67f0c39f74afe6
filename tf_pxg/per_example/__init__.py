"""The engine's per-example backward pass.

- `backward`: backprop to the interface, then each op's per-example rule
  (`per_example_gradient`, norms, clipped sums in one pass);
- `merge_uses`: a parameter consumed by several ops, its uses' per-example
  terms merged.

Layer table: tests/test_import_graph.py (`ENGINE_LAYERS`).
"""

"""The engine's interface layer: where the examples are.

- `batch_axis`: which axis of each tensor holds the examples, and the
  row-wise ops that keep them apart;
- `classify`: at the ops that consume the parameters (the interface),
  whether each input is per-example data, a parameter or a constant, and
  where the rule takes the examples;
- `batch_copies`: tensors that repeat the batch (augmult copies, tiles);
- `normalise`: the normal forms rules see (einsum, reshapes, casts).

Layer table: tests/test_import_graph.py (`ENGINE_LAYERS`).
"""

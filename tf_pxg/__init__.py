"""tf_pxg: per-example gradients and DP-SGD for TensorFlow 2 and Keras 3.

Public API: `GradientTape`, `register`, `registered_op_types`,
`register_row_wise` and `row_wise_op_types` (the allowlist of ops that keep
examples apart, `tf_pxg.interface.batch_axis`), and the
submodules `tf_pxg.keras`, `tf_pxg.data` (Poisson sampling), `tf_pxg.dp`,
`tf_pxg.accounting`, `tf_pxg.risk` (μ-GDP and the best attack's TPR at
a low FPR of a run's events), `tf_pxg.testing`, `tf_pxg.rules`,
`tf_pxg.audit`,
`tf_pxg.clipping` (flat, automatic and quantile-adaptive clipping),
`tf_pxg.mf` (BandMF correlated-noise strategies) and `tf_pxg.parts` (how
samplers, noise mechanisms and clipping policies are registered by name,
and the list of the built-in ones; docs/extending.md). TensorFlow is
imported on first use of a name that needs it, so `tf_pxg.accounting` and
the `tf-pxg` command start without it.
"""

import importlib

from tf_pxg import _versions

_versions.check()

__all__ = ["GradientTape", "register", "register_row_wise",
           "registered_op_types", "row_wise_op_types"]
__version__ = "0.1.0"

_LAZY = {"GradientTape": ("tf_pxg.gradient_tape", "GradientTape"),
         # Through tf_pxg.rules, so the built-in rules are registered first.
         "register": ("tf_pxg.rules", "register"),
         "registered_op_types": ("tf_pxg.rules", "registered_op_types"),
         "register_row_wise": ("tf_pxg.interface.batch_axis", "register_row_wise"),
         "row_wise_op_types": ("tf_pxg.interface.batch_axis", "row_wise_op_types")}


def __getattr__(name):
  if name in _LAZY:
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)
  if name in ("keras", "accounting", "risk", "testing", "rules", "dp",
              "data", "audit", "mf", "parts", "tuning", "probability"):
    return importlib.import_module(f"tf_pxg.{name}")
  if name == "batch_axis":  # the row-wise allowlist (the engine's layer)
    return importlib.import_module("tf_pxg.interface.batch_axis")
  if name == "clipping":  # the clipping policies
    return importlib.import_module("tf_pxg.dp.clipping")
  raise AttributeError(f"module 'tf_pxg' has no attribute '{name}'")

"""Empirical privacy auditing: ε lower bounds from one training run.

* `CanaryScoreAuditor(in_canary_scores, out_canary_scores)`: the one-run
  bound of Steinke, Nasr and Jagielski (2023) (`epsilon_one_run`), the
  classical Clopper-Pearson bound (`epsilon_clopper_pearson`),
  `tpr_at_fpr` and `auroc`. Pure NumPy/SciPy (no TensorFlow).
* `CanaryCallback`: puts m canaries into a `fit` run (each with probability
  1/2) and scores them afterwards, returning the auditor.

A lower bound above the claimed ε proves the training is not as private as
claimed; one below it proves nothing. See `docs/auditing.md` and the module
docstrings for the derivations.
"""

import importlib

from tf_pxg.audit.auditor import CanaryScoreAuditor
from tf_pxg.audit.auditor import one_run_epsilon
from tf_pxg.audit.auditor import one_run_p_value

__all__ = ["CanaryCallback", "CanaryScoreAuditor", "one_run_epsilon",
           "one_run_p_value"]


def __getattr__(name):
  # Keras is imported only when the callback is asked for.
  if name == "CanaryCallback":
    return importlib.import_module("tf_pxg.audit.canaries").CanaryCallback
  raise AttributeError(f"module 'tf_pxg.audit' has no attribute '{name}'")
